"""Small adapters that plug a ZephonLoader into trainer frameworks (optional dependencies)."""
