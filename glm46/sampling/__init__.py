"""Rejection sampling (`task=sample`): candidates drawn from a model (draw), judged by GLM-4.5's filters (filters),
the best of each prompt written as chat JSONL for the next SFT (rejection); prompts from a prepared dataset or JSONL
(prompt_records)."""
