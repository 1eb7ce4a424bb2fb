"""mlx-dspark engine: lossless speculative decoding on MLX.

The one door for the server, MCP tools and benchmark:

    engine = Engine(model_path)                # loads once; one thread owns MLX
    ids = engine.render_chat(messages)         # or engine.encode(text)
    for event in engine.generate(GenerationRequest(ids, max_tokens=256)):
        ...                                    # PrefillProgress, Tokens, Done
"""

from .batch_cost import BatchSurface, load_batch_surface, surface_for, tune_batch
from .cost_curve import CostCurve, cache_dir, curve_for_requests, curve_key, load_cost_curve, tune
from .draft_control import DraftController, best_draft_cap
from .prefill_chunk import tune_prefill
from .prefill_estimate import prefill_report
from .roofline import machine_report, measure_bandwidth, roofline
from .benchmark import CONTENTS as BENCH_CONTENTS
from .benchmark import Content as BenchContent
from .benchmark import build_content as build_bench_content
from .benchmark import format_table as format_bench_table
from .benchmark import run_benchmark, run_nonce
from .drafter import Draft, Drafter
from .engine import DEFAULT_MAX_DRAFT, Engine, GenerationRequest, Job
from .errors import CancelledError, EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError
from .events import Done, PrefillProgress, Stats, Tokens
from . import cpu_attention
from .lookup import LookupDrafter
from .model_catalog import ModelInfo, find_models, model_locations, pairing_problems, weights_missing
from .models import REFERENCE_MODEL_DIR, default_model_path, local_models
from .modes import available_modes
from .platform import describe_platform, ensure_fast_blas, loaded_blas, slow_blas_warning
from .sampling import SamplingParams
from .target import Target, load_target

__all__ = [
    "BatchSurface",
    "load_batch_surface",
    "surface_for",
    "tune_batch",
    "BENCH_CONTENTS",
    "BenchContent",
    "CostCurve",
    "DraftController",
    "best_draft_cap",
    "build_bench_content",
    "cache_dir",
    "curve_for_requests",
    "curve_key",
    "format_bench_table",
    "load_cost_curve",
    "machine_report",
    "measure_bandwidth",
    "roofline",
    "run_benchmark",
    "run_nonce",
    "tune",
    "loaded_blas",
    "prefill_report",
    "tune_prefill",
    "slow_blas_warning",
    "CancelledError",
    "DEFAULT_MAX_DRAFT",
    "Done",
    "Draft",
    "Drafter",
    "Engine",
    "EngineError",
    "GenerationRequest",
    "InvalidRequestError",
    "Job",
    "LookupDrafter",
    "ModelLoadError",
    "PrefillProgress",
    "PromptTooLongError",
    "REFERENCE_MODEL_DIR",
    "SamplingParams",
    "Stats",
    "Target",
    "Tokens",
    "available_modes",
    "default_model_path",
    "local_models",
    "ModelInfo",
    "find_models",
    "model_locations",
    "pairing_problems",
    "weights_missing",
    "describe_platform",
    "ensure_fast_blas",
    "load_target",
]
