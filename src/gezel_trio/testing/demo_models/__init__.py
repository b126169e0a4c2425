"""Small random-weight demo models, built locally with no download, for
tests, benchmarks and examples (``gezel-trio demo-model``). The builder and
what each kind is: ``_builder``. MLX is imported only while a model builds,
so importing this stays cheap.
"""

from ._builder import (
    BUILDER_VERSION,
    CONTROL_TOKENS,
    ENDOFTEXT_ID,
    FIM_TOKENS,
    IM_END_ID,
    IM_START_ID,
    IMAGE_TOKEN,
    SPECIAL_TOKENS,
    UNK_ID,
    DemoKind,
    DemoSize,
    default_root,
    demo_model_path,
    ensure_demo_model,
)

__all__ = [
    "BUILDER_VERSION",
    "CONTROL_TOKENS",
    "ENDOFTEXT_ID",
    "FIM_TOKENS",
    "IMAGE_TOKEN",
    "IM_END_ID",
    "IM_START_ID",
    "SPECIAL_TOKENS",
    "UNK_ID",
    "DemoKind",
    "DemoSize",
    "default_root",
    "demo_model_path",
    "ensure_demo_model",
]
