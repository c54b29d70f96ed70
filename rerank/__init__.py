"""Re-ranking a shortlist with local descriptors (spatial verification, Chamfer similarity, AMES,
global+local score ensembles). Not built yet: the foundation slice ranks by global descriptors only."""
