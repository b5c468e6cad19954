import argparse
import dataclasses

import pytest

from atom.config import CacheConfig, CompilationConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from atom.engine.arg_utils import EngineArgs


def parse(argv):
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(argv))


def test_cli_defaults_follow_the_guide():
    args = parse([])
    assert (args.tensor_parallel_size, args.data_parallel_size, args.block_size) == (1, 1, 16)
    assert (args.max_num_batched_tokens, args.max_num_seqs, args.gpu_memory_utilization) == (None, 512, 0.9)
    assert (args.kv_cache_dtype, args.level, args.port, args.num_speculative_tokens) == ("bf16", 3, 8006, 1)
    assert args.cudagraph_capture_sizes[:4] == [1, 2, 4, 8] and args.cudagraph_capture_sizes[-1] == 256
    assert not (args.enforce_eager or args.enable_prefix_caching or args.load_dummy)


def test_step_budget_by_device(tiny_model):
    """The guide's 16,384 tokens a step on a GPU; on the CPU vLLM's server budget, 2,048, so a long
    prompt is prefilled in chunks that other requests' steps come between."""
    import torch

    from atom.engine.arg_utils import default_max_num_batched_tokens

    assert default_max_num_batched_tokens(torch.device("cuda")) == 16384
    assert default_max_num_batched_tokens(torch.device("cpu")) == 2048
    config = EngineArgs(model=tiny_model("qwen3"), device="cpu").create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 2048
    config = EngineArgs(model=tiny_model("qwen3"), device="cpu", max_num_batched_tokens=5000).create_engine_config()
    assert config.scheduler_config.max_num_batched_tokens == 5000


def test_max_model_len_below_one_is_refused(tiny_model):
    import pytest

    for bad in (0, -5):
        with pytest.raises(ValueError, match="max_model_len must be at least 1"):
            EngineArgs(model=tiny_model("qwen3"), device="cpu", max_model_len=bad).create_engine_config()


def test_server_port_spellings():
    """The HTTP port: vLLM's --port, and the seed guide's --server-port."""
    from atom.entrypoints.openai_server import make_arg_parser

    assert make_arg_parser().parse_args(["--server-port", "8123"]).http_port == 8123
    assert make_arg_parser().parse_args(["--port", "8124"]).http_port == 8124
    assert make_arg_parser().parse_args([]).http_port == 8000


def test_cli_spellings():
    args = parse(["--model", "m", "-tp", "2", "-dp", "3", "--enforce-eager", "--enable_prefix_caching",
                  "--kv_cache_dtype", "fp8", "--block-size", "32", "--max-model-len", "99",
                  "--cudagraph-capture-sizes", "[1,2,3]", "--load_dummy", "--method", "mtp",
                  "--num-speculative-tokens", "2", "--torch-profiler-dir", "/tmp/p", "--level", "0"])
    assert (args.model, args.tensor_parallel_size, args.data_parallel_size) == ("m", 2, 3)
    assert args.enforce_eager and args.enable_prefix_caching and args.load_dummy
    assert (args.kv_cache_dtype, args.block_size, args.max_model_len) == ("fp8", 32, 99)
    assert args.cudagraph_capture_sizes == [1, 2, 3]
    assert (args.method, args.num_speculative_tokens, args.torch_profiler_dir, args.level) == ("mtp", 2, "/tmp/p", 0)
    # vLLM's spellings of the same switch
    assert parse(["--enable-prefix-caching"]).enable_prefix_caching
    assert not parse(["--enable-prefix-caching", "--no-enable-prefix-caching"]).enable_prefix_caching


def test_async_scheduling_is_on_unless_turned_off():
    assert parse([]).async_scheduling
    assert parse(["--async-scheduling"]).async_scheduling
    assert not parse(["--no-async-scheduling"]).async_scheduling


@pytest.mark.parametrize("make", [
    lambda: CacheConfig(block_size=12),
    lambda: CacheConfig(gpu_memory_utilization=1.5),
    lambda: CacheConfig(kv_cache_dtype="int4"),
    lambda: SchedulerConfig(max_num_seqs=0),
    lambda: SchedulerConfig(scheduler_delay_factor=-1),
    lambda: CompilationConfig(level=5),
])
def test_invalid_config_rejected_at_construction(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("section", [CacheConfig, SchedulerConfig, ParallelConfig, CompilationConfig,
                                     SpeculativeConfig])
def test_every_config_field_is_an_engine_argument_with_the_same_default(section):
    args = EngineArgs()
    for f in dataclasses.fields(section):
        value = getattr(args, f.name)  # an AttributeError names a config field no argument sets
        if f.name == "max_num_batched_tokens":  # by device: test_step_budget_by_device
            assert value is None
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        assert (tuple(value) if isinstance(value, list) else value) == default, f.name
