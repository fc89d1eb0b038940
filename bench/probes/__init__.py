"""Measurements outside the numbered tables: the control path, the data plane's pieces, the soak test."""
