"""The ground floor every stage stands on: typed errors, atomic writes, hashing, checkpoint
reading and the local-token types. Torch-free at import time; imports no stage."""
