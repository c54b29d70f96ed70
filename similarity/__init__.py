"""Similarity methods from the related papers, on frozen features: the adaptation function
(``similarity/afn/*.py``), adaptors with attention fusion (``similarity/adaptors/*.py``), foreground
feature averaging (``similarity/ffa/*.py``), and two-alternative forced choice with
context-sensitive ensembles (``similarity/twoafc/*.py``). Each method is split into modules of one
job each (settings, data, torch networks and training, evaluation, CLI; the ``*/config.py`` module
describes the method); each trains, applies and evaluates through ``needle similarity <method> ...``
with its own metric (eval/)."""
