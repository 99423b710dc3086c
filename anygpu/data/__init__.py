"""Training data: sources (raw files, hub, stdlib), tokenizer (load or train a BPE), formats (text,
prompt-completion, messages: detection, masks, truncation), chat_template (rendering, assistant tokens,
the default template), packing (raw text into blocks), collate (samples packed or padded into batches),
samples (the cached encoded rows), order (the seeded global order), loader (its steps through a DataLoader). Tokenising and packing run once per
corpus × tokenizer × options. Raw text at scale: files (folders, globs, parts), readers (documents, bad rows), corpus
(sources → units), token_units (a part → token streams), shared_prep (the job's ranks share the parts), token_rows
(memory-mapped blocks), corpus_rows (rows, order and eval sets of a prepared corpus), mixture_order."""
