"""The facade: ``RemoteDataLoader``, its options, its figures and profile."""
