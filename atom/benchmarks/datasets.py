"""Prompt sources for the serving benchmark, all read from local files (nothing is downloaded).

Adapted from vLLM's ``benchmarks/benchmark_dataset.py``. Each dataset yields ``SampleRequest``s
(prompt, prompt tokens, expected output tokens) counted with the benchmark's tokenizer:
``random`` synthetic prompts; ``sharegpt`` a ShareGPT JSON file; ``sonnet`` a text file of poem
lines; ``burstgpt`` a BurstGPT trace CSV; ``hf`` a dataset saved with ``save_to_disk`` or a local
``.json``/``.jsonl``/``.csv``/``.parquet`` file.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any

import numpy as np
from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

DATASET_NAMES = ["sharegpt", "burstgpt", "sonnet", "random", "hf"]


@dataclass
class SampleRequest:
    prompt: str
    prompt_len: int
    expected_output_len: int


def num_tokens(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    """Tokens in ``text`` itself, without the BOS/EOS the tokenizer may add."""
    return len(tokenizer.encode(text, add_special_tokens=False))


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, prompt: str) -> str:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("The tokenizer has no chat template; it is needed for --use-chat-template and the "
                         "sonnet dataset. Use a chat model's tokenizer (--tokenizer).")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                         add_generation_prompt=True)


def is_valid_sequence(prompt_len: int, output_len: int, min_len: int = 4, max_prompt_len: int = 1024,
                      max_total_len: int = 2048, skip_min_output_len_check: bool = False) -> bool:
    """vLLM's pruning rule for real datasets: drop very short or very long pairs."""
    output_too_short = not skip_min_output_len_check and output_len < min_len
    return not (prompt_len < min_len or output_too_short or prompt_len > max_prompt_len
                or prompt_len + output_len > max_total_len)


class BenchmarkDataset:
    def __init__(self, dataset_path: str | None = None, random_seed: int = 0) -> None:
        self.dataset_path = dataset_path
        self.random_seed = random_seed
        # own generators: sampling is reproducible whatever else uses the global random state
        self.rng = random.Random(random_seed)
        self.np_rng = np.random.default_rng(random_seed)

    def _require_file(self, what: str) -> str:
        if not self.dataset_path:
            raise ValueError(f"The {what} dataset needs --dataset-path pointing to a local file.")
        if not os.path.isfile(self.dataset_path):
            raise FileNotFoundError(f"{what} dataset file not found: {self.dataset_path}")
        return self.dataset_path

    def oversample(self, requests: list[SampleRequest], num_requests: int) -> list[SampleRequest]:
        """Repeat random samples when the data holds fewer usable entries than requested."""
        if not requests:
            raise ValueError(f"No usable samples in {self.dataset_path}.")
        return requests + self.rng.choices(requests, k=max(num_requests - len(requests), 0))


def prompt_token_ids(tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """Token ids usable in synthetic prompts: not special (they would change the prompt's meaning),
    and decoding to text that encodes back to the same single token (byte fragments of a UTF-8
    character decode to U+FFFD and would keep prompts from reaching their target length)."""
    special_ids = set(tokenizer.all_special_ids)
    candidates = [i for i in range(tokenizer.vocab_size) if i not in special_ids]
    encoded = tokenizer(tokenizer.batch_decode([[i] for i in candidates]), add_special_tokens=False).input_ids
    allowed = [i for i, ids in zip(candidates, encoded) if ids == [i]]
    # for a tokenizer where almost nothing round-trips, length fitting is approximate but works
    return np.array(allowed if len(allowed) >= len(candidates) // 10 else candidates)


class RandomDataset(BenchmarkDataset):
    """Prompts of random tokens, lengths drawn uniformly from ``[int(length * range_ratio), length]``
    (1.0 = fixed). Decoding random ids and encoding the text again changes the token count, so each
    prompt's tail is padded or trimmed until it re-encodes to its target length; ``prompt_len`` is
    always the measured length of the final prompt."""

    MAX_LENGTH_FIXES = 10

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, prefix_len: int = 0,
               range_ratio: float = 1.0, input_len: int = 1024, output_len: int = 128,
               use_chat_template: bool = False, **kwargs) -> list[SampleRequest]:
        if not 0.0 <= range_ratio <= 1.0:
            raise ValueError(f"--random-range-ratio must be in [0, 1], got {range_ratio}.")
        if input_len < 1 or output_len < 1 or prefix_len < 0:
            raise ValueError("--random-input-len and --random-output-len must be >= 1, --random-prefix-len >= 0.")
        allowed_ids = prompt_token_ids(tokenizer)
        template_len = 0
        if use_chat_template:  # the template's tokens count towards input_len
            template_len = num_tokens(tokenizer, apply_chat_template(tokenizer, "a")) - 1
            if input_len - template_len < 1:
                raise ValueError(f"--random-input-len {input_len} leaves no room for the chat template "
                                 f"({template_len} tokens).")
            input_len -= template_len
        # a shared prefix of identical text, e.g. to measure prefix caching
        prefix_text = tokenizer.decode(self.np_rng.choice(allowed_ids, size=prefix_len).tolist()) if prefix_len else ""
        input_lens, output_lens = (self.np_rng.integers(int(n * range_ratio), n + 1, size=num_requests)
                                   for n in (input_len, output_len))
        offsets = self.np_rng.integers(0, len(allowed_ids), size=num_requests)
        requests, mismatches = [], []
        for i in range(num_requests):
            target_len = prefix_len + int(input_lens[i])
            # consecutive ids from a random offset, as in vLLM: cheap and different for every request
            body_ids = allowed_ids[(offsets[i] + i + np.arange(input_lens[i])) % len(allowed_ids)].tolist()
            prompt = self._fit_length(tokenizer, prefix_text, body_ids, target_len, allowed_ids)
            if use_chat_template:
                prompt, target_len = apply_chat_template(tokenizer, prompt), target_len + template_len
            requests.append(SampleRequest(prompt, num_tokens(tokenizer, prompt), int(output_lens[i])))
            mismatches.append(requests[-1].prompt_len - target_len)
        in_lens = [r.prompt_len for r in requests]
        logger.info("Random dataset: input_lens %d..%d (mean %.2f, mean token mismatch %.2f), output_lens %d..%d",
                    min(in_lens), max(in_lens), np.mean(in_lens), np.mean(mismatches), min(output_lens),
                    max(output_lens))
        return requests

    def _fit_length(self, tokenizer, prefix_text: str, body_ids: list[int], target_len: int, allowed_ids) -> str:
        # only the body is adjusted, so every prompt starts with exactly the same prefix text
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


def _conversation_pair(turns: list[dict[str, Any]]) -> tuple[str, str | None]:
    # ShareGPT style ({"from", "value"}) or OpenAI style ({"role", "content"})
    texts = [t.get("value", t.get("content")) for t in turns]
    return texts[0], texts[1] if len(texts) > 1 else None


def prompt_and_completion(record: dict[str, Any]) -> tuple[str, str | None]:
    """Prompt and reference completion of a record in the layouts vLLM supports (ShareGPT-like,
    AIMO, InstructCoder) or a plain prompt/completion layout."""
    if record.get("conversations") or record.get("messages"):
        return _conversation_pair(record.get("conversations") or record["messages"])
    if "problem" in record:
        return record["problem"], record.get("solution")
    if "instruction" in record:
        extra = f":\n{record['input']}" if record.get("input") else ""
        return record["instruction"] + extra, record.get("output")
    for key in ("prompt", "question", "text"):
        if key in record:
            completions = [record[k] for k in ("completion", "response", "answer", "output") if record.get(k)]
            return record[key], completions[0] if completions else None
    raise ValueError(f"Cannot find a prompt in hf dataset record with columns {sorted(record)}. Expected one of: "
                     "'conversations', 'messages', 'problem', 'instruction', 'prompt', 'question', 'text'.")


def _datasets_module(what: str):
    try:
        import datasets
    except ImportError as err:
        raise ImportError(f"Reading {what} needs the 'datasets' package (pip install datasets).") from err
    return datasets


def load_local_records(path: str, subset: str | None = None, split: str | None = None) -> list[dict[str, Any]]:
    if subset and os.path.isdir(os.path.join(path, subset)):
        path = os.path.join(path, subset)
    ext = os.path.splitext(path)[1].lower()
    if os.path.isdir(path):
        datasets = _datasets_module("a saved Hugging Face dataset directory")
        data = datasets.load_from_disk(path)
        if isinstance(data, datasets.DatasetDict):
            data = data[split or ("train" if "train" in data else next(iter(data)))]
        return list(data)
    if not os.path.isfile(path):
        raise ValueError(f"--dataset-path {path!r} is not a local file or directory. The hf dataset is only read "
                         "from local data, never downloaded: save it beforehand, e.g. `datasets.load_dataset(NAME, "
                         "split=SPLIT).save_to_disk(DIR)`, and pass DIR, or pass a local .json/.jsonl/.csv/.parquet "
                         "file.")
    with open(path, newline="", encoding="utf-8") as f:
        if ext == ".jsonl":
            return [json.loads(line) for line in f if line.strip()]
        if ext == ".json":
            data = json.load(f)
            return data if isinstance(data, list) else data[split or "train"]
        if ext == ".csv":
            return list(csv.DictReader(f))
    if ext in (".parquet", ".arrow"):
        return list(_datasets_module(f"{ext} files").load_dataset(ext[1:], data_files=path, split="train"))
    raise ValueError(f"Unsupported hf dataset file type {ext!r}: use .json, .jsonl, .csv or .parquet.")


class HuggingFaceDataset(BenchmarkDataset):
    """Prompt/completion records from local data; the completion's length is the output length."""

    DEFAULT_OUTPUT_LEN = 128  # for records without a completion
    WHAT = "hf"

    def __init__(self, dataset_subset: str | None = None, dataset_split: str | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        if not self.dataset_path:
            raise ValueError(f"The {self.WHAT} dataset needs --dataset-path (a local dataset directory or file).")
        self.data = [prompt_and_completion(r) for r in self._records(dataset_subset, dataset_split)]
        self.rng.shuffle(self.data)

    def _records(self, subset: str | None, split: str | None) -> list[dict[str, Any]]:
        return load_local_records(self.dataset_path, subset, split)

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, output_len: int | None = None,
               **kwargs) -> list[SampleRequest]:
        samples: list[SampleRequest] = []
        for prompt, completion in self.data:
            if len(samples) >= num_requests:
                break
            if not prompt:
                continue
            prompt_len = len(tokenizer(prompt).input_ids)
            n = output_len if output_len is not None else self.DEFAULT_OUTPUT_LEN
            if output_len is None and completion:
                n = len(tokenizer(completion).input_ids)
            if self._keep(prompt_len, n, fixed=output_len is not None, measured=bool(completion)):
                samples.append(SampleRequest(prompt, prompt_len, n))
        return self.oversample(samples, num_requests)

    def _keep(self, prompt_len: int, output_len: int, fixed: bool, measured: bool) -> bool:
        return fixed or not measured or is_valid_sequence(prompt_len, output_len)


class ShareGPTDataset(HuggingFaceDataset):
    """First human turn as the prompt, the first reply's length as the output length."""

    WHAT = "ShareGPT"

    def _records(self, subset: str | None, split: str | None) -> list[dict[str, Any]]:
        with open(self._require_file("ShareGPT"), encoding="utf-8") as f:
            return [e for e in json.load(f) if len(e.get("conversations", [])) >= 2]

    def _keep(self, prompt_len: int, output_len: int, fixed: bool, measured: bool) -> bool:
        return is_valid_sequence(prompt_len, output_len, skip_min_output_len_check=fixed)


class SonnetDataset(BenchmarkDataset):
    """Prompts asking the model to pick poem lines; the leading lines form a shared prefix."""

    BASE_PROMPT = "Pick as many lines as you can from these poem lines:\n"

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        with open(self._require_file("sonnet"), encoding="utf-8") as f:
            self.data = [line for line in f if line.strip()]
        if not self.data:
            raise ValueError(f"The sonnet file {self.dataset_path} has no lines.")

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, prefix_len: int = 200,
               input_len: int = 550, output_len: int = 150, return_prompt_formatted: bool = False,
               **kwargs) -> list[SampleRequest]:
        avg_line_len = np.mean([len(tokenizer(line).input_ids) for line in self.data])
        base_offset = len(tokenizer(apply_chat_template(tokenizer, self.BASE_PROMPT)).input_ids)
        if input_len <= base_offset:
            raise ValueError(f"'input_len' must be higher than the base prompt length ({base_offset}).")
        num_input_lines = round((input_len - base_offset) / avg_line_len)
        num_prefix_lines = max(round((prefix_len - base_offset) / avg_line_len), 0)
        if num_input_lines <= num_prefix_lines:
            raise ValueError(f"--sonnet-input-len {input_len} must leave room for lines after the prefix of "
                             f"--sonnet-prefix-len {prefix_len} tokens.")
        samples: list[SampleRequest] = []
        # random lines may overshoot input_len and are redrawn; the cap turns a hopeless setting into an error
        for _ in range(100 * num_requests):
            if len(samples) >= num_requests:
                break
            lines = self.data[:num_prefix_lines] + self.rng.choices(self.data, k=num_input_lines - num_prefix_lines)
            prompt = self.BASE_PROMPT + "".join(lines)
            formatted = apply_chat_template(tokenizer, prompt)
            prompt_len = len(tokenizer(formatted).input_ids)
            if prompt_len <= input_len:
                samples.append(SampleRequest(formatted if return_prompt_formatted else prompt, prompt_len, output_len))
        if len(samples) < num_requests:
            raise ValueError(f"Could not build sonnet prompts of at most {input_len} tokens.")
        return samples


class BurstGPTDataset(BenchmarkDataset):
    """Request/response lengths of a BurstGPT trace's GPT-4 rows with a response, as random prompts."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        with open(self._require_file("BurstGPT"), newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        try:
            self.data = [(int(float(r["Request tokens"])), int(float(r["Response tokens"]))) for r in rows
                         if r["Model"] == "GPT-4" and float(r["Response tokens"]) > 0]
        except KeyError as err:
            raise ValueError(f"{self.dataset_path} is not a BurstGPT CSV: missing column {err}. Expected the "
                             "columns 'Model', 'Request tokens' and 'Response tokens'.") from err
        if not self.data:
            raise ValueError(f"No GPT-4 rows with a response in {self.dataset_path}.")

    def sample(self, tokenizer: PreTrainedTokenizerBase, num_requests: int, **kwargs) -> list[SampleRequest]:
        rows = (self.rng.sample(self.data, num_requests) if num_requests <= len(self.data)
                else self.rng.choices(self.data, k=num_requests))
        prompts = RandomDataset(random_seed=self.random_seed)
        return [prompts.sample(tokenizer, 1, input_len=max(i, 1), output_len=o)[0] for i, o in rows]


def get_samples(args: argparse.Namespace, tokenizer: PreTrainedTokenizerBase) -> list[SampleRequest]:
    """The benchmark's requests for the dataset named by ``args.dataset_name``."""
    name, n, files = args.dataset_name, args.num_prompts, dict(dataset_path=args.dataset_path, random_seed=args.seed)
    if args.use_chat_template and name != "random":
        logger.warning("--use-chat-template only applies to the random dataset; ignored for %s.", name)
    if args.use_chat_template and args.backend == "openai-chat":
        logger.warning("--use-chat-template with the openai-chat backend applies the chat template twice.")
    if name == "random":
        return RandomDataset(random_seed=args.seed).sample(
            tokenizer, n, prefix_len=args.random_prefix_len, range_ratio=args.random_range_ratio,
            input_len=args.random_input_len, output_len=args.random_output_len,
            use_chat_template=args.use_chat_template)
    if name == "sharegpt":
        return ShareGPTDataset(**files).sample(tokenizer, n, output_len=args.sharegpt_output_len)
    if name == "sonnet":  # a chat server applies the template itself; the completions API needs the templated text
        return SonnetDataset(**files).sample(
            tokenizer, n, prefix_len=args.sonnet_prefix_len, input_len=args.sonnet_input_len,
            output_len=args.sonnet_output_len, return_prompt_formatted=args.backend != "openai-chat")
    if name == "burstgpt":
        return BurstGPTDataset(**files).sample(tokenizer, n)
    if name == "hf":
        return HuggingFaceDataset(dataset_subset=args.hf_subset, dataset_split=args.hf_split, **files).sample(
            tokenizer, n, output_len=args.hf_output_len)
    raise ValueError(f"Unknown dataset: {name}. Choices: {DATASET_NAMES}")
