"""Tests of the ``kpool-pd`` command line (``up``, its report) and of the installed package."""
