"""Tests of the project's shape: import layers, declared dependencies, the tests' own log reading."""
