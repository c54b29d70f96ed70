"""FAISS indexes over descriptor Parquet files: building, loading and searching (plain library)."""
