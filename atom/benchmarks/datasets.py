"""Prompt sources for the serving benchmark.

Adapted from vLLM's ``benchmarks/benchmark_dataset.py``. Every dataset turns
into a list of ``SampleRequest`` (prompt, prompt length in tokens, expected
output length in tokens), counted with the benchmark's tokenizer.

All data is read from local files; nothing is downloaded:

* ``random``   synthetic prompts of a given token length (no file needed);
* ``sharegpt`` a JSON file in ShareGPT format (a list of ``{"conversations": [...]}``);
* ``sonnet``   a text file of poem lines (vLLM's ``benchmarks/sonnet.txt``);
* ``burstgpt`` a BurstGPT trace CSV (request/response token counts of GPT-4 rows);
* ``hf``       a dataset saved with ``datasets.Dataset.save_to_disk`` or a local
  ``.json``/``.jsonl``/``.csv``/``.parquet`` file.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATASET_NAMES = ["sharegpt", "burstgpt", "sonnet", "random", "hf"]


@dataclass
class SampleRequest:
    """One benchmark request: the prompt and its token lengths."""

    prompt: str
    prompt_len: int
    expected_output_len: int


def num_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens in ``text`` itself, without the BOS/EOS the tokenizer may add."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    """Wrap ``prompt`` as a single user turn in the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            "The tokenizer has no chat template; it is needed for --use-chat-template "
            "and for the sonnet dataset. Use a chat model's tokenizer (--tokenizer)."
        )
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )


def is_valid_sequence(
    prompt_len: int,
    output_len: int,
    min_len: int = 4,
    max_prompt_len: int = 1024,
    max_total_len: int = 2048,
    skip_min_output_len_check: bool = False,
) -> bool:
    """vLLM's pruning rule for real datasets: drop very short or very long pairs."""
    prompt_too_short = prompt_len < min_len
    output_too_short = (not skip_min_output_len_check) and output_len < min_len
    prompt_too_long = prompt_len > max_prompt_len
    combined_too_long = prompt_len + output_len > max_total_len
    return not (prompt_too_short or output_too_short or prompt_too_long or combined_too_long)


class BenchmarkDataset:
    DEFAULT_SEED = 0

    def __init__(self, dataset_path: str | None = None, random_seed: int = DEFAULT_SEED) -> None:
        self.dataset_path = dataset_path
        self.random_seed = random_seed if random_seed is not None else self.DEFAULT_SEED
        # Each dataset has its own generator so that sampling is reproducible
        # and independent of whatever else uses the global random state.
        self.rng = random.Random(self.random_seed)
        self.np_rng = np.random.default_rng(self.random_seed)

    def _require_file(self, what: str) -> str:
        if not self.dataset_path:
            raise ValueError(f"The {what} dataset needs --dataset-path pointing to a local file.")
        if not os.path.isfile(self.dataset_path):
            raise FileNotFoundError(f"{what} dataset file not found: {self.dataset_path}")
        return self.dataset_path

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, **kwargs) -> list[SampleRequest]:
        raise NotImplementedError

    def maybe_oversample_requests(self, requests: list[SampleRequest], num_requests: int) -> None:
        """Repeat random samples when the data holds fewer usable entries than requested."""
        if not requests:
            raise ValueError(f"No usable samples in {self.dataset_path}.")
        if len(requests) < num_requests:
            requests.extend(self.rng.choices(requests, k=num_requests - len(requests)))
            logger.info("Oversampled requests to reach %d total samples.", num_requests)


# ---------------------------------------------------------------------------
# Random (synthetic) prompts
# ---------------------------------------------------------------------------


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Token ids usable in synthetic prompts: those that decode to text which
    encodes back to the same single token.

    Special tokens (BOS, EOS, chat markers) are excluded because they would
    change the meaning of the prompt. Byte-level tokens holding part of a UTF-8
    character are excluded because they decode to U+FFFD, which re-encodes to
    different tokens and keeps prompts from reaching their target length.
    """
    special_ids = set(tokenizer.all_special_ids)
    candidates = [i for i in range(tokenizer.vocab_size) if i not in special_ids]
    texts = tokenizer.batch_decode([[i] for i in candidates])
    encoded = tokenizer(texts, add_special_tokens=False).input_ids
    allowed = [i for i, ids in zip(candidates, encoded) if ids == [i]]
    # Unusual tokenizers might round-trip almost nothing; then length fitting
    # is approximate but still works.
    return np.array(allowed if len(allowed) >= len(candidates) // 10 else candidates)


class RandomDataset(BenchmarkDataset):
    """Prompts made of random tokens, with lengths drawn uniformly from
    ``[int(length * range_ratio), length]`` (ATOM's convention: 1.0 = fixed length).

    Decoding random token ids and encoding the text again does not give back
    the same number of tokens, so each prompt is re-encoded and its tail padded
    or trimmed until it has the target length (or a few attempts ran out).
    ``prompt_len`` is always the measured length of the final prompt.
    """

    DEFAULT_PREFIX_LEN = 0
    DEFAULT_RANGE_RATIO = 1.0
    DEFAULT_INPUT_LEN = 1024
    DEFAULT_OUTPUT_LEN = 128
    MAX_LENGTH_FIXES = 10

    def sample(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_requests: int,
        prefix_len: int = DEFAULT_PREFIX_LEN,
        range_ratio: float = DEFAULT_RANGE_RATIO,
        input_len: int = DEFAULT_INPUT_LEN,
        output_len: int = DEFAULT_OUTPUT_LEN,
        use_chat_template: bool = False,
        **kwargs,
    ) -> list[SampleRequest]:
        if not 0.0 <= range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}.")
        if input_len < 1 or output_len < 1 or prefix_len < 0:
            raise ValueError(
                "--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0."
            )

        allowed_ids = prompt_token_ids(tokenizer)

        template_len = 0
        if use_chat_template:
            # Tokens the template adds around the user text, so that the
            # templated prompt still has about input_len tokens in total.
            template_len = num_tokens(tokenizer, apply_chat_template(tokenizer, "a")) - 1
            if input_len - template_len < 1:
                raise ValueError(
                    f"--random-input-len {input_len} leaves no room for the chat template "
                    f"({template_len} tokens)."
                )
            input_len -= template_len

        # A shared prefix of identical text, e.g. to measure prefix caching.
        prefix_ids = self.np_rng.choice(allowed_ids, size=prefix_len).tolist()
        prefix_text = tokenizer.decode(prefix_ids) if prefix_len > 0 else ""

        input_lens = self._uniform_lengths(input_len, range_ratio, num_requests)
        output_lens = self._uniform_lengths(output_len, range_ratio, num_requests)
        offsets = self.np_rng.integers(0, len(allowed_ids), size=num_requests)
        logger.info(
            "Random dataset: input_len in [%d, %d] (+%d prefix, +%d template), output_len in [%d, %d]",
            int(input_len * range_ratio),
            input_len,
            prefix_len,
            template_len,
            int(output_len * range_ratio),
            output_len,
        )

        requests = []
        mismatches = []
        for i in range(num_requests):
            target_len = prefix_len + int(input_lens[i])
            # Consecutive ids from a random offset, as in vLLM: cheap and
            # different for every request.
            body_ids = allowed_ids[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed_ids)].tolist()
            prompt = self._fit_length(tokenizer, prefix_text, body_ids, target_len, allowed_ids)
            if use_chat_template:
                prompt = apply_chat_template(tokenizer, prompt)
                target_len += template_len
            prompt_len = num_tokens(tokenizer, prompt)
            mismatches.append(prompt_len - target_len)
            requests.append(SampleRequest(prompt, prompt_len, int(output_lens[i])))

        in_lens = [r.prompt_len for r in requests]
        logger.info(
            "Random dataset: input_lens min=%d max=%d mean=%.2f avg_token_mismatch=%.2f; "
            "output_lens min=%d max=%d mean=%.2f",
            min(in_lens),
            max(in_lens),
            np.mean(in_lens),
            np.mean(mismatches),
            min(output_lens),
            max(output_lens),
            np.mean(output_lens),
        )
        return requests

    def _uniform_lengths(self, length: int, range_ratio: float, n: int) -> np.ndarray:
        return self.np_rng.integers(int(length * range_ratio), length + 1, size=n)

    def _fit_length(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prefix_text: str,
        body_ids: list[int],
        target_len: int,
        allowed_ids: np.ndarray,
    ) -> str:
        # Only the body after the prefix is adjusted, so every prompt starts
        # with exactly the same prefix text.
        body_text = tokenizer.decode(body_ids)
        for _ in range(self.MAX_LENGTH_FIXES):
            diff = target_len - num_tokens(tokenizer, prefix_text + body_text)
            if diff == 0:
                break
            body_ids = tokenizer.encode(body_text, add_special_tokens=False)
            if diff > 0:
                body_ids += self.np_rng.choice(allowed_ids, size=diff).tolist()
            else:
                body_ids = body_ids[: max(len(body_ids) + diff, 0)]
            body_text = tokenizer.decode(body_ids)
        return prefix_text + body_text


# ---------------------------------------------------------------------------
# ShareGPT
# ---------------------------------------------------------------------------


class ShareGPTDataset(BenchmarkDataset):
    """First human turn as prompt, first reply's length as output length."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        path = self._require_file("ShareGPT")
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        self.data = [e for e in data if len(e.get("conversations", [])) >= 2]
        self.rng.shuffle(self.data)

    def sample(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_requests: int,
        output_len: int | None = None,
        **kwargs,
    ) -> list[SampleRequest]:
        samples: list[SampleRequest] = []
        for entry in self.data:
            if len(samples) >= num_requests:
                break
            prompt = entry["conversations"][0]["value"]
            completion = entry["conversations"][1]["value"]
            prompt_len = len(tokenizer(prompt).input_ids)
            new_output_len = len(tokenizer(completion).input_ids) if output_len is None else output_len
            if not is_valid_sequence(
                prompt_len, new_output_len, skip_min_output_len_check=output_len is not None
            ):
                continue
            samples.append(SampleRequest(prompt, prompt_len, new_output_len))
        self.maybe_oversample_requests(samples, num_requests)
        return samples


# ---------------------------------------------------------------------------
# Sonnet
# ---------------------------------------------------------------------------


class SonnetDataset(BenchmarkDataset):
    """Prompts asking the model to pick poem lines; a fixed set of leading lines
    forms a shared prefix."""

    DEFAULT_PREFIX_LEN = 200
    DEFAULT_INPUT_LEN = 550
    DEFAULT_OUTPUT_LEN = 150
    BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        with open(self._require_file("sonnet"), encoding="utf-8") as f:
            self.data = [line for line in f.readlines() if line.strip()]
        if not self.data:
            raise ValueError(f"The sonnet file {self.dataset_path} has no lines.")

    def sample(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_requests: int,
        prefix_len: int = DEFAULT_PREFIX_LEN,
        input_len: int = DEFAULT_INPUT_LEN,
        output_len: int = DEFAULT_OUTPUT_LEN,
        return_prompt_formatted: bool = False,
        **kwargs,
    ) -> list[SampleRequest]:
        avg_line_len = np.mean([len(tokenizer(line).input_ids) for line in self.data])
        base_offset = len(tokenizer(apply_chat_template(tokenizer, self.BASE_PROMPT)).input_ids)
        if input_len <= base_offset:
            raise ValueError(f"'input_len' must be higher than the base prompt length ({base_offset}).")

        num_input_lines = round((input_len - base_offset) / avg_line_len)
        num_prefix_lines = max(round((prefix_len - base_offset) / avg_line_len), 0)
        if num_input_lines <= num_prefix_lines:
            raise ValueError(
                f"--sonnet-input-len {input_len} must leave room for lines after the "
                f"prefix of --sonnet-prefix-len {prefix_len} tokens."
            )
        prefix_lines = self.data[:num_prefix_lines]

        samples: list[SampleRequest] = []
        # Random lines may overshoot input_len; such draws are rejected. The cap
        # turns a hopeless configuration into an error instead of a hang.
        for _ in range(100 * num_requests):
            if len(samples) >= num_requests:
                break
            extra_lines = self.rng.choices(self.data, k=num_input_lines - num_prefix_lines)
            prompt = f"{self.BASE_PROMPT}{''.join(prefix_lines + extra_lines)}"
            prompt_formatted = apply_chat_template(tokenizer, prompt)
            prompt_len = len(tokenizer(prompt_formatted).input_ids)
            if prompt_len <= input_len:
                samples.append(
                    SampleRequest(
                        prompt_formatted if return_prompt_formatted else prompt, prompt_len, output_len
                    )
                )
        if len(samples) < num_requests:
            raise ValueError(f"Could not build sonnet prompts of at most {input_len} tokens.")
        return samples


# ---------------------------------------------------------------------------
# BurstGPT
# ---------------------------------------------------------------------------


class BurstGPTDataset(BenchmarkDataset):
    """Request/response lengths from a BurstGPT trace (GPT-4 rows with a
    response only), with synthetic prompts of those lengths."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        with open(self._require_file("BurstGPT"), newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        try:
            self.data = [
                (int(float(r["Request tokens"])), int(float(r["Response tokens"])))
                for r in rows
                if r["Model"] == "GPT-4" and float(r["Response tokens"]) > 0
            ]
        except KeyError as err:
            raise ValueError(
                f"{self.dataset_path} is not a BurstGPT CSV: missing column {err}. Expected the columns "
                "'Model', 'Request tokens' and 'Response tokens'."
            ) from err
        if not self.data:
            raise ValueError(f"No GPT-4 rows with a response in {self.dataset_path}.")

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, **kwargs) -> list[SampleRequest]:
        if num_requests <= len(self.data):
            rows = self.rng.sample(self.data, num_requests)
        else:
            rows = self.rng.choices(self.data, k=num_requests)
        # Build each prompt like a one-off random prompt of the trace's length.
        random_prompts = RandomDataset(random_seed=self.random_seed)
        samples = []
        for input_len, output_len in rows:
            [request] = random_prompts.sample(
                tokenizer, 1, input_len=max(input_len, 1), output_len=output_len, range_ratio=1.0
            )
            samples.append(request)
        return samples


# ---------------------------------------------------------------------------
# Hugging Face datasets, from local data only
# ---------------------------------------------------------------------------


def _load_local_records(path: str, subset: str | None, split: str | None) -> list[dict[str, Any]]:
    if subset and os.path.isdir(os.path.join(path, subset)):
        path = os.path.join(path, subset)
    if os.path.isdir(path):
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                "Reading a saved Hugging Face dataset directory needs the 'datasets' package "
                "(pip install datasets)."
            ) from err
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            split = split or ("train" if "train" in data else next(iter(data)))
            data = data[split]
        return list(data)
    if not os.path.isfile(path):
        raise ValueError(
            f"--dataset-path {path!r} is not a local file or directory. The hf dataset is only read "
            "from local data, never downloaded: save it beforehand, e.g. "
            "`datasets.load_dataset(NAME, split=SPLIT).save_to_disk(DIR)`, and pass DIR, or pass a "
            "local .json/.jsonl/.csv/.parquet file."
        )
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    if ext == ".json":
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return data if isinstance(data, list) else data[split or "train"]
    if ext == ".csv":
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    if ext in (".parquet", ".arrow"):
        try:
            import datasets
        except ImportError as err:
            raise ImportError(
                f"Reading {ext} files needs the 'datasets' package (pip install datasets)."
            ) from err
        return list(datasets.load_dataset(ext[1:], data_files=path, split="train"))
    raise ValueError(f"Unsupported hf dataset file type {ext!r}: use .json, .jsonl, .csv or .parquet.")


def _conversation_pair(turns: list[dict[str, Any]]) -> tuple[str, str | None]:
    # ShareGPT style ({"from", "value"}) or OpenAI style ({"role", "content"}).
    texts = [t.get("value", t.get("content")) for t in turns]
    return texts[0], texts[1] if len(texts) > 1 else None


def _prompt_and_completion(record: dict[str, Any]) -> tuple[str, str | None]:
    """The prompt and reference completion of one record, for the column layouts
    of the datasets vLLM supports (ShareGPT-like, AIMO, InstructCoder) and the
    plain prompt/completion layout."""
    if record.get("conversations"):
        return _conversation_pair(record["conversations"])
    if record.get("messages"):
        return _conversation_pair(record["messages"])
    if "problem" in record:
        return record["problem"], record.get("solution")
    if "instruction" in record:
        prompt = record["instruction"]
        if record.get("input"):
            prompt = f"{prompt}:\n{record['input']}"
        return prompt, record.get("output")
    for prompt_key in ("prompt", "question", "text"):
        if prompt_key in record:
            for completion_key in ("completion", "response", "answer", "output"):
                if record.get(completion_key):
                    return record[prompt_key], record[completion_key]
            return record[prompt_key], None
    raise ValueError(
        f"Cannot find a prompt in hf dataset record with columns {sorted(record)}. Expected one of: "
        "'conversations', 'messages', 'problem', 'instruction', 'prompt', 'question', 'text'."
    )


class HuggingFaceDataset(BenchmarkDataset):
    DEFAULT_OUTPUT_LEN = 128

    def __init__(self, dataset_subset: str | None = None, dataset_split: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.dataset_path:
            raise ValueError("The hf dataset needs --dataset-path (a local dataset directory or file).")
        self.data = _load_local_records(self.dataset_path, dataset_subset, dataset_split)
        self.rng.shuffle(self.data)

    def sample(
        self,
        tokenizer: PreTrainedTokenizerBase,
        num_requests: int,
        output_len: int | None = None,
        **kwargs,
    ) -> list[SampleRequest]:
        samples: list[SampleRequest] = []
        for record in self.data:
            if len(samples) >= num_requests:
                break
            prompt, completion = _prompt_and_completion(record)
            if not prompt:
                continue
            prompt_len = len(tokenizer(prompt).input_ids)
            if output_len is not None:
                new_output_len = output_len
            elif completion:
                new_output_len = len(tokenizer(completion).input_ids)
                if not is_valid_sequence(prompt_len, new_output_len):
                    continue
            else:
                new_output_len = self.DEFAULT_OUTPUT_LEN
            samples.append(SampleRequest(prompt, prompt_len, new_output_len))
        self.maybe_oversample_requests(samples, num_requests)
        return samples


# ---------------------------------------------------------------------------
# Entry point used by benchmark_serving
# ---------------------------------------------------------------------------


def get_samples(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> list[SampleRequest]:
    """The benchmark's requests for the dataset named by ``args.dataset_name``."""
    name = args.dataset_name
    builders: dict[str, Callable[[], list[SampleRequest]]] = {
        "random": lambda: RandomDataset(random_seed=args.seed).sample(
            tokenizer,
            args.num_prompts,
            prefix_len=args.random_prefix_len,
            range_ratio=args.random_range_ratio,
            input_len=args.random_input_len,
            output_len=args.random_output_len,
            use_chat_template=args.use_chat_template,
        ),
        "sharegpt": lambda: ShareGPTDataset(dataset_path=args.dataset_path, random_seed=args.seed).sample(
            tokenizer, args.num_prompts, output_len=args.sharegpt_output_len
        ),
        "sonnet": lambda: SonnetDataset(dataset_path=args.dataset_path, random_seed=args.seed).sample(
            tokenizer,
            args.num_prompts,
            prefix_len=args.sonnet_prefix_len,
            input_len=args.sonnet_input_len,
            output_len=args.sonnet_output_len,
            # A chat server applies the template itself; the completions API
            # needs the templated text.
            return_prompt_formatted=args.backend != "openai-chat",
        ),
        "burstgpt": lambda: BurstGPTDataset(dataset_path=args.dataset_path, random_seed=args.seed).sample(
            tokenizer, args.num_prompts
        ),
        "hf": lambda: HuggingFaceDataset(
            dataset_path=args.dataset_path,
            dataset_subset=args.hf_subset,
            dataset_split=args.hf_split,
            random_seed=args.seed,
        ).sample(tokenizer, args.num_prompts, output_len=args.hf_output_len),
    }
    if name not in builders:
        raise ValueError(f"Unknown dataset: {name}. Choices: {DATASET_NAMES}")
    if args.use_chat_template and name != "random":
        logger.warning("--use-chat-template only applies to the random dataset; ignored for %s.", name)
    if args.use_chat_template and args.backend == "openai-chat":
        logger.warning("--use-chat-template with the openai-chat backend applies the chat template twice.")
    return builders[name]()
