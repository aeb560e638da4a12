"""``cdbench profile``: grammar engines side by side on real specs, in isolated worker processes."""
