"""Evaluation with lm-evaluation-harness (task=eval): a trained model's weights on the prepared dataset's
held-out documents (glm46.eval.lm_eval_tasks) and on any local lm-eval task, offline.

    from glm46.eval import evaluate, summarize
    results = evaluate(cfg.eval, "<run or HF dir>", output_dir)  # lm-eval's results; writes output_dir/eval/
    summarize(results)  # {"glm46_arithmetic/exact_match": 0.31, "glm46_arithmetic/n": 99, ...}
"""

from glm46.eval.evaluation import evaluate, summarize

__all__ = ["evaluate", "summarize"]
