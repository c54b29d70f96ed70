"""The query path: embed the query (global descriptor and local tokens) with the model the index
was built with, search the index, re-rank the shortlist with local tokens. ``index/`` knows
vectors, not models; this package joins them."""
