"""Similarity methods from the related papers, on frozen features: the adaptation function
(``similarity/afn_*.py``), adaptors with attention fusion (``similarity/adaptors_*.py``), foreground
feature averaging (``similarity/ffa_*.py``), and two-alternative forced choice with
context-sensitive ensembles (``similarity/twoafc_*.py``). Each method is split into modules of one
job each (settings, data, torch networks and training, evaluation, CLI; the ``*_config.py`` module
describes the method); each trains, applies and evaluates through ``needle similarity <method> ...``
with its own metric (eval/)."""
