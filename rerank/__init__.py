"""Re-ranking a shortlist with local tokens: tentative correspondences (matching), spatial
verification (spatial), Chamfer similarity (chamfer), AMES (ames, ames_train), the global+local
score ensemble (ensemble), and one query's re-ranking (rerank). Plain library code: the query path
(query/retrieve.py) calls it."""
