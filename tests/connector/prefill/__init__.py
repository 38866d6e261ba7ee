"""Tests of the connector's prefill role: grants, offers, its service edge under attack, UCX address vetting."""
