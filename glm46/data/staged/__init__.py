"""`task=prepare` over many tasks (`prepare.tasks=N`): the one-process preparation (glm46.data.prepare) cut into
stages whose tasks run side by side, on this machine or as dependent Slurm job arrays, with the same result.

    read      [N]  each task reads its input files (contiguous, in input order), normalises, applies max_chars,
                   finds each document's quality verdict, content and URL digests, MinHash signature and LSH band
                   keys, and sends every key to the task that owns its value (value mod N)
    exact     [N]  per owned content digest: the first document in input order stays
    url       [N]  the same for normalised URLs, among the documents exact deduplication kept
    bands     [N]  per owned LSH bucket, among the documents still kept: the documents that share it (edges)
    clusters  [1]  connected components of those edges, dealt out over N groups
    near      [N]  per group, in input order, MinHashLSH's keep-first check (glm46.data.dedup.near_duplicates)
    perplexity_model [1], perplexity [N]
                   with prepare.perplexity: CCNet's filter, an n-gram model fitted (or given) and every kept prose
                   document scored (glm46.data.staged.perplexity)
    toxicity  [N]  with prepare.toxicity.max: each kept prose document's most offensive sentence scored
    tokenizer [1]  trains the BPE on the kept documents in the one-process order, or checks the given one
    tokenize  [N]  each read task's kept documents -> token and document parts, per domain
    merge     [N]  each part written into the one-process files at its offset, all tasks at once; the digests
                   of the token fingerprint's pieces within it
    finish    [1]  the fingerprint, shards.json, tokenizer.json, manifest.json (the counts merged)

Near-duplicate decisions only ever compare documents that share a band, so they fall within a connected component
and the keep-first loop run per component, in input order, decides exactly what the one-process loop decides.

The work lives in `<output_dir>/.staged/`: `plan.json`, then one folder per finished task (written under a
temporary name and renamed, so a task that dies leaves nothing that looks finished); a rerun of the same command
runs only the tasks that have not finished.
"""
