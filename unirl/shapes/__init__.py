"""The shapes world: a tiny text-to-image task where learning is visible.

Procedurally rendered 32x32 scenes of coloured shapes (`world`) and a
weight-free GenEval-in-miniature scorer (`scorer`). See README.md.
"""

from unirl.shapes.scorer import (
    Detection,
    GenEvalMini,
    classify_pixels,
    classify_shape,
    connected_components,
    detect,
    evaluate,
    relation_holds,
    score_scene,
    summarize,
)
from unirl.shapes.world import (
    BACKGROUND,
    CATEGORIES,
    COLORS,
    PALETTE,
    RELATIONS,
    SHAPES,
    SceneSpec,
    ShapesDataset,
    ShapeSpec,
    all_scenes,
    held_out_objects,
    is_eval_scene,
    parse_prompt,
    prompt_id,
    render,
    scene_to_prompt,
    split_scenes,
)

__all__ = [
    "BACKGROUND",
    "CATEGORIES",
    "COLORS",
    "PALETTE",
    "RELATIONS",
    "SHAPES",
    "Detection",
    "GenEvalMini",
    "SceneSpec",
    "ShapeSpec",
    "ShapesDataset",
    "all_scenes",
    "classify_pixels",
    "classify_shape",
    "connected_components",
    "detect",
    "evaluate",
    "held_out_objects",
    "is_eval_scene",
    "parse_prompt",
    "prompt_id",
    "relation_holds",
    "render",
    "scene_to_prompt",
    "score_scene",
    "split_scenes",
    "summarize",
]
