"""The quality study: a real corpus and tokenizer from the machine's packages, RULER-style retrieval
probes, dense vs Flash-MSA from scratch and dense -> NSA conversion (docs/quality.md).

``python -m msa_train.quality {corpus,study-a,study-b,study-c,all,report,probe} ...``
"""
