"""Tests of the Kubernetes manifests and container images of ``deploy/``."""
