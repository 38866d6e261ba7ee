"""Tests of ``kpool-pd bench``."""
