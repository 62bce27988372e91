"""Write a preference-pair file of the shapes world for offline Diffusion-DPO.

Per pair: a training scene's prompt, a correct render of it (chosen) and a render of the
same scene with one object's colour changed (rejected: what GenEvalMini's colour check
fails). Output: <out>/pairs.jsonl ({"prompt", "chosen", "rejected"}, paths relative to it)
and <out>/images/*.png (32x32 RGB).

    python scripts/make_shapes_pairs.py --out datasets/shapes_pairs --num-pairs 128 --seed 0
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import numpy as np
from PIL import Image

from worlds.shapes.world import COLORS, ShapesDataset, ShapeSpec, render, scene_to_prompt


def recolored(spec, rng: np.random.Generator):
    """The scene with its first object's colour changed to another (random) colour."""
    first = spec.objects[0]
    color = rng.choice([c for c in COLORS if c != first.color])
    return dataclasses.replace(spec, objects=[ShapeSpec(str(color), first.shape), *spec.objects[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--num-pairs", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    scenes = ShapesDataset("train", seed=0).scenes
    os.makedirs(os.path.join(args.out, "images"), exist_ok=True)
    with open(os.path.join(args.out, "pairs.jsonl"), "w") as f:
        for i in range(args.num_pairs):
            spec = scenes[rng.integers(len(scenes))]
            row = {"prompt": scene_to_prompt(spec)}
            for key, scene in (("chosen", spec), ("rejected", recolored(spec, rng))):
                name = f"images/{i:04d}_{key}.png"
                Image.fromarray(render(scene, rng)).save(os.path.join(args.out, name))
                row[key] = name
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
