"""Model loading, architectures, the MTP head and caches."""
