"""Tests of ``kpool_pd.connector`` that involve both roles: plans, pulls between nodes, the service edge, transports."""
