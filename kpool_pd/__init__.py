"""The kpool-pd command line (nothing imports this package but the entry point)."""
