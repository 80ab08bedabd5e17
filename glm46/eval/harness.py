"""lm-evaluation-harness's model interface over GLM46ForCausalLM, registered as `glm46`, so that
`lm_eval --model glm46 --model_args pretrained=<run or HF dir>` works as glm46.eval.evaluate does.

Requests are answered as lm-eval's HFLM answers them for transformers' Glm4MoeForCausalLM, so the two agree on
the same weights (tests/test_eval.py):
- loglikelihood: context + continuation (its last max_length + 1 tokens) scored in right-padded batches of
  requests sorted by length: the continuation's summed log-probabilities, and whether each token was the argmax.
  Only the continuation's positions go through lm_head, and the MTP layers (which `forward` runs) are skipped.
- loglikelihood_rolling: each text in lm-eval's disjoint rolling windows of max_length tokens, the first
  conditioned on <|endoftext|> (the token before every document in training).
- generate_until: greedy (GLM46ForCausalLM.generate on left-padded prompts), stopping at GLM's stop tokens and at
  an `until` string of one token; the reply is cut at the first stop token, then at the first `until` string.
  Special tokens other than the stop tokens stay in the text (HFLM decodes without them). A request whose
  generation_kwargs name `tools` (glm46.data.tools.TOOLS) plays a tool episode instead (glm46.rl.episodes, greedy,
  up to `max_turns` turns of up to max_gen_toks tokens): the answer is the whole transcript after the prompt, the
  model's turns with their stop tokens and the tool results, so that a task scores its last turn. This is glm46's
  own extension: lm-eval's other models generate one turn.
Special-token strings in a request (`[gMASK]<sop><|user|>...`) encode as their ids, as in training and in HF's
tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from glm46.checkpoint import find_weights, load_hf
from glm46.data.chat import EOS, STOP_TOKENS
from glm46.data.tokenizer import GLMTokenizer
from glm46.data.tools import environment
from glm46.logs import Progress, rank_zero_logger
from glm46.modules.model import positions_after
from glm46.rl.episodes import run_episodes
from glm46.rl.turns import ModelTurns

log = rank_zero_logger(__name__)


def find_tokenizer(weights: Path, fallback: str | Path | None) -> Path:
    """tokenizer.json beside the weights, else `fallback` (eval.tokenizer: the prepared dataset's)."""
    for candidate in (weights / "tokenizer.json", fallback):
        if candidate is not None and Path(candidate).is_file():
            return Path(candidate).absolute()
    raise FileNotFoundError(f"no tokenizer: {weights / 'tokenizer.json'} and {fallback} (eval.tokenizer) do not exist")


@register_model("glm46")
class GLM46LM(TemplateLM):
    """pretrained: an HF or run directory; tokenizer: a tokenizer.json for weights without one beside them;
    max_length: the context (at most, and by default, the model's max_position_embeddings); max_gen_toks: for
    requests that name none."""

    def __init__(
        self,
        pretrained: str,
        tokenizer: str | None = None,
        batch_size: int | str = 32,
        max_length: int | None = None,
        max_gen_toks: int = 64,
        device: str = "cpu",
        dtype: str = "float32",
    ):
        super().__init__()
        self.weights = find_weights(pretrained)
        self._device = torch.device(device)
        self.model = load_hf(self.weights, getattr(torch, dtype), self._device).eval()
        self.tokenizer_file = find_tokenizer(self.weights, tokenizer)
        self.tokenizer = GLMTokenizer.from_file(self.tokenizer_file)
        if self.tokenizer.vocab_size > self.model.config.vocab_size:
            raise ValueError(
                f"{self.tokenizer_file} has {self.tokenizer.vocab_size} tokens, more than the model's vocab_size="
                f"{self.model.config.vocab_size} ({self.weights}): they do not belong together"
            )
        positions = self.model.config.max_position_embeddings
        self.max_length = min(int(max_length or positions), positions)
        self.batch_size, self.max_gen_toks = int(batch_size), int(max_gen_toks)
        self.stop_ids = [self.tokenizer.token_id(token) for token in STOP_TOKENS]

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.token_id(EOS)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tokenizer.encode(string)

    def get_model_info(self) -> dict:
        """What results.json's `config` records about the model (lm-eval asks every model for it)."""
        return {
            "model_path": str(self.weights),
            "tokenizer_path": str(self.tokenizer_file),
            "model_num_parameters": sum(p.numel() for p in self.model.parameters()),
            "model_dtype": str(self.model.lm_head.weight.dtype),
            "max_length": self.max_length,
        }

    def _score(self, hidden: torch.Tensor, targets: list[list[int]]) -> list[tuple[float, bool]]:
        """(summed log-probabilities, all argmax) of each target sequence, after the final hidden states [N, hidden]
        of its positions (all targets' positions concatenated); logits are made loss_chunk_size rows at a time."""
        flat = torch.tensor([token for target in targets for token in target], device=self.device)
        chunk, lls, greedy = self.model.loss_chunk_size, [], []
        for rows, tokens in zip(hidden.split(chunk), flat.split(chunk)):
            logprobs = torch.log_softmax(self.model.lm_head(rows).float(), dim=-1)
            lls.append(logprobs.gather(1, tokens[:, None])[:, 0])
            greedy.append(logprobs.argmax(dim=-1) == tokens)
        lengths = [len(target) for target in targets]
        pairs = zip(torch.cat(lls).split(lengths), torch.cat(greedy).split(lengths))
        return [(float(ll.sum()), bool(argmax.all())) for ll, argmax in pairs]

    @torch.inference_mode()
    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) -> (sum of the continuation's log-probabilities, greedy)."""
        collator = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])))
        results, progress = [], Progress(log, "eval log-likelihoods", len(requests), "requests")
        for chunk in collator.get_batched(n=self.batch_size):
            inputs = [(context + continuation)[-(self.max_length + 1) :][:-1] for _, context, continuation in chunk]
            targets = [continuation for _, _, continuation in chunk]
            if any(len(target) > self.max_length for target in targets):
                raise ValueError(f"a continuation is longer than max_length={self.max_length} tokens")
            width = max(map(len, inputs))
            ids = torch.tensor([row + [self.eot_token_id] * (width - len(row)) for row in inputs], device=self.device)
            hidden, _ = self.model.model(ids, positions_after(None, ids))
            scored = torch.cat([hidden[i, len(x) - len(t) : len(x)] for i, (x, t) in enumerate(zip(inputs, targets))])
            results += self._score(scored, targets)
            progress.advance(len(chunk))
        return collator.get_original(results)

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        windows, owners = [], []
        for number, (text,) in enumerate(request.args for request in requests):
            for window in get_rolling_token_windows(self.tok_encode(text), self.prefix_token_id, self.max_length, 1):
                windows.append((None, *make_disjoint_window(window)))
                owners.append(number)
        totals = [0.0] * len(requests)
        for number, (loglikelihood, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[number] += loglikelihood
        return totals

    @torch.inference_mode()
    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        collator = Collator(
            [request.args for request in requests],
            sort_fn=lambda args: (-len(self.tok_encode(args[0])), args[0]),
            group_by="gen_kwargs",
            group_fn=lambda args: args[1],
        )
        results, progress = [], Progress(log, "eval generation", len(requests), "requests")
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, gen_kwargs = zip(*chunk)
            kwargs = dict(gen_kwargs[0])
            tools, max_turns = kwargs.pop("tools", None), kwargs.pop("max_turns", 1)
            kwargs = normalize_gen_kwargs(kwargs, self.max_gen_toks)
            until, new_tokens = kwargs["until"], kwargs["max_gen_toks"]
            if kwargs["do_sample"] or new_tokens >= self.max_length:
                raise ValueError(f"glm46 generates greedily, fewer than max_length={self.max_length} tokens: {kwargs}")
            prompts = [self.tok_encode(context)[-(self.max_length - new_tokens) :] for context in contexts]
            if tools:
                results += self._episodes(prompts, tools, max_turns, new_tokens)
                progress.advance(len(chunk))
                continue
            stops = self.stop_ids + [ids[0] for ids in map(self.tok_encode, until) if len(ids) == 1]
            width = max(map(len, prompts))
            ids = torch.tensor([[self.eot_token_id] * (width - len(p)) + p for p in prompts], device=self.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device)
            output = self.model.generate(ids, new_tokens, temperature=0.0, eos_token_id=stops, attention_mask=mask)
            for row in output[:, width:].tolist():
                end = next((i for i, token in enumerate(row) if token in stops), len(row))
                results.append(postprocess_generated_text(self.tokenizer.decode(row[:end]), until, None))
            progress.advance(len(chunk))
        return collator.get_original(results)

    def _episodes(self, prompts: list[list[int]], tools: list[str], max_turns: int, turn_tokens: int) -> list[str]:
        """Each prompt's greedy tool episode, as the transcript after the prompt."""
        greedy = ModelTurns(self.model, self.stop_ids, self.eot_token_id, self.device)
        environments = [environment(list(tools)) for _ in prompts]
        played = run_episodes(
            prompts, [{}] * len(prompts), greedy, self.tokenizer, lambda record, text: 0.0, environments, max_turns,
            max_turns * turn_tokens, turn_tokens=turn_tokens,
        )  # fmt: skip
        return [self.tokenizer.decode(episode.tokens) for episode in played]
