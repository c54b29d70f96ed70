"""Images to descriptors: the model registry, pooling, and extractors (plain library, no Ray)."""
