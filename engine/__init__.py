"""mlx-dspark engine: lossless speculative decoding on MLX.

The one door for the server, MCP tools and benchmark:

    engine = Engine(model_path)                # loads once; one thread owns MLX (EngineConfig's
                                               # fields as keywords: Engine(path, mode="lookup"))
    ids = engine.render_chat(messages)         # or engine.encode(text)
    for event in engine.generate(GenerationRequest(ids, max_tokens=256)):
        ...                                    # PrefillProgress, Tokens, Done
"""

from engine.base.bundled import REFERENCE_MODEL_DIR, default_model_path
from engine.base.errors import CancelledError, EngineDownError, EngineError, InvalidRequestError, ModelLoadError, PromptTooLongError
from engine.base.events import Done, PrefillProgress, Stats, Tokens
from engine.base.files import cache_dir
from engine.base.measurements import forget_measurements
from engine.base.platform import describe_platform, ensure_fast_blas, loaded_blas, physical_memory_bytes, slow_blas_warning
from engine.base.sampling import SamplingParams
from engine.bench.benchmark import CONTENTS as BENCH_CONTENTS, Content as BenchContent, build_content as build_bench_content, format_table as format_bench_table, run_benchmark, run_nonce
from engine.catalog.model_catalog import ModelInfo, find_models, local_models, model_locations, pairing_problems, weights_missing
from engine.decoding.grammar import Constraint
from engine.drafting.drafter import Draft, Drafter
from engine.drafting.lookup import LookupDrafter
from engine.drafting.modes import available_modes
from engine.engine import DEFAULT_MAX_DRAFT, Engine, EngineConfig, GenerationRequest, Job
from engine.kernels import cpu_attention
from engine.model.target import Target, load_target
from engine.tuning.batch_cost import BatchSurface, load_batch_surface, surface_for, tune_batch
from engine.tuning.cost_curve import CostCurve, curve_for_requests, curve_key, load_cost_curve, tune
from engine.tuning.draft_control import DraftController, best_draft_cap
from engine.tuning.prefill_chunk import tune_prefill
from engine.tuning.prefill_estimate import prefill_report
from engine.tuning.roofline import machine_report, measure_bandwidth, roofline

__all__ = [
    "Constraint",
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
    "forget_measurements",
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
    "physical_memory_bytes",
    "CancelledError",
    "EngineDownError",
    "DEFAULT_MAX_DRAFT",
    "Done",
    "Draft",
    "Drafter",
    "Engine",
    "EngineConfig",
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
