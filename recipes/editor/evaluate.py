"""How well the editor does on held-out pictures, measured as a run measures (8-bit pictures):

- the VAE's round trip (PSNR and SSIM against the picture);
- per instruction, the VAE's ceiling: the round trip of the correct edit itself, judged as an output is (what a DiT
  that put out the correct edit's exact latents would score);
- per instruction and picture, the run's measures against the correct edit (``ditrun.metrics.target``): PSNR, the
  CIEDE2000 colour difference, and the margin over the naive candidates (the input unchanged, every other known
  edit of the input). An edit whose correct result equals the input has no margin (no output can beat doing
  nothing there).
"""

from __future__ import annotations

import numpy as np
import torch

from ditrun.editor import transforms
from ditrun.metrics.target import make_target, psnr, scores
from ditrun.model.latents import pack, token_ids, unpack
from ditrun.model.sampler import EditInputs, denoise, sequential_cfg_velocity
from ditrun.results.files import to_rgb8
from recipes.editor import pictures
from recipes.editor.config import TrainConfig, device_problem
from recipes.editor.data import EMPTY_PROMPT


def reference_pictures(size: int, device: torch.device, names) -> torch.Tensor:
    """The pictures ``names`` (held-out or training) resized to size x size, as a run's references are (8-bit, PIL
    Lanczos).
    -> [N, 3, size, size] in [0, 1]"""
    from PIL import Image

    out = []
    for name in names:
        rgb8 = np.round(pictures.load(name) * 255).astype(np.uint8)
        img = np.asarray(Image.fromarray(rgb8).resize((size, size), resample=Image.LANCZOS), dtype=np.float32) / 255
        out.append(torch.from_numpy(img).permute(2, 0, 1))
    return torch.stack(out).to(device)


def rgb8(images: torch.Tensor) -> list[np.ndarray]:
    """[N, 3, H, W] in [0, 1] -> N pictures [H, W, 3] uint8, as a run saves them."""
    return [to_rgb8(image[None]) for image in images]


def roundtrip(codec, refs: torch.Tensor, names) -> dict:
    """The VAE's round trip of each picture: {name: {"psnr", "ssim"}}."""
    from ditrun.metrics.quality import ssim

    back = rgb8(codec.decode(codec.encode(refs)))
    return {n: {"psnr": psnr(b, r), "ssim": ssim(b, r)} for n, b, r in zip(names, back, rgb8(refs))}


def ceiling(codec, refs: torch.Tensor, names) -> dict:
    """Each correct edit of each picture through the VAE and back, judged as an edit is:
    {edit: {picture: {"psnr", "delta_e", "margin"}}}. No DiT can score better through this VAE."""
    return judge_each(refs, names, lambda edit: codec.decode(codec.encode(edit.transform(refs))))


def margin(output: np.ndarray, reference: np.ndarray, edit: str, known: dict) -> dict:
    """One edit of one picture: PSNR and colour difference against the correct edit, and the margin over the naive
    candidates (None when the correct result is the input). ``known``: every edit's correct result of that picture,
    by name."""
    target = make_target(known[edit], reference, known)
    if target.equals_input:
        return {"psnr": psnr(output, target.image), "delta_e": None, "margin": None}
    measured = scores(output, target)
    return {"psnr": measured["psnr_target"], "delta_e": measured["delta_e_target"], "margin": measured["margin_db"]}


@torch.no_grad()
def sample_edits(
    model, codec, refs: torch.Tensor, prompt, negative, steps: int, cfg_scale: float, seed: int
) -> torch.Tensor:
    """One edit of each reference with ditrun's sampler (``denoise`` + true CFG), noise seeded as a run's.

    refs: [B, 3, S, S] in [0, 1]; prompt, negative: ([L, D], [P]) -> [B, 3, S, S] in [0, 1]
    """
    from ditrun.workload.inputs import initial_noise

    batch, device, latent = refs.shape[0], refs.device, refs.shape[-1] // 8
    dtype = next(model.parameters()).dtype
    noise = torch.cat([initial_noise(seed + i, latent, latent, dtype) for i in range(batch)]).to(device)
    inputs = EditInputs(
        noise=noise,
        ref_latents=pack(codec.encode(refs)),
        img_ids=token_ids(latent, latent, 0, device),
        ref_ids=token_ids(latent, latent, 1, device),
        prompt=prompt[0].expand(batch, -1, -1),
        pooled=prompt[1].expand(batch, -1),
        txt_ids=torch.zeros(prompt[0].shape[0], 3, device=device),
    )
    if cfg_scale > 1:
        inputs.neg_prompt, inputs.neg_pooled = negative[0].expand(batch, -1, -1), negative[1].expand(batch, -1)
    velocity = sequential_cfg_velocity(model, inputs, cfg_scale, None, dtype)
    latents = denoise(velocity, inputs.noise, steps)
    return codec.decode(unpack(latents, latent, latent))


def edits(model, codec, refs: torch.Tensor, names, prompt_of, scale: float, steps: int, seed: int) -> dict:
    """Every instruction (its first phrasing) on every picture: {edit: {picture: {"psnr", "delta_e", "margin"}}}."""
    negative = prompt_of(EMPTY_PROMPT)
    return judge_each(
        refs,
        names,
        lambda edit: sample_edits(model, codec, refs, prompt_of(edit.phrasings[0]), negative, steps, scale, seed),
    )


def judge_each(refs: torch.Tensor, names, output_of) -> dict:
    """Every instruction's outputs (``output_of(edit)`` -> [N, 3, S, S] in [0, 1]) judged against its correct
    edit of each picture: {edit: {picture: {"psnr", "delta_e", "margin"}}}."""
    references = rgb8(refs)
    known = {name: rgb8(transforms.apply(name, refs)) for name in transforms.EDITS.names()}  # name -> per picture
    return {
        edit_name: dict(zip(names, _margins(rgb8(output_of(edit)), references, edit_name, known)))
        for edit_name, edit in transforms.EDITS.items()
    }


def _margins(outputs, references, edit: str, known: dict) -> list[dict]:
    """``margin`` of each picture's output; ``known``: every edit's correct results (name -> one per picture)."""
    return [
        margin(o, r, edit, {k: v[i] for k, v in known.items()}) for i, (o, r) in enumerate(zip(outputs, references))
    ]


def posterize_levels(codec, refs: torch.Tensor, names, levels) -> dict:
    """How well ``posterize`` could be measured through this VAE if it kept each of ``levels`` levels per channel:
    the input unchanged against the correct result, and the VAE's ceiling (the correct result through the VAE and
    back) with its margin over the naive candidates, the other edits as they are. -> {levels: medians and minimum}"""
    references = rgb8(refs)
    others = {name: rgb8(transforms.apply(name, refs)) for name in transforms.EDITS.names() if name != "posterize"}
    out = {}
    for count in levels:
        correct = transforms.posterize(refs, count)
        known = {**others, "posterize": rgb8(correct)}
        cells = _margins(rgb8(codec.decode(codec.encode(correct))), references, "posterize", known)
        out[count] = {
            "input_psnr_median": float(np.median([psnr(r, c) for r, c in zip(references, known["posterize"])])),
            "ceiling_psnr_median": float(np.median([c["psnr"] for c in cells])),
            "ceiling_margin_median": float(np.median([c["margin"] for c in cells])),
            "ceiling_margin_min": float(min(c["margin"] for c in cells)),
        }
    return out


def summarize(per_edit: dict) -> dict:
    """Per instruction and over all: median PSNR, median margin, and how many edits beat every naive candidate."""

    def stats(cells):
        margins = [c["margin"] for c in cells if c["margin"] is not None]
        colour = [c["delta_e"] for c in cells if c["delta_e"] is not None]
        return {
            "psnr_median": float(np.median([c["psnr"] for c in cells])),
            "delta_e_median": float(np.median(colour)) if colour else None,
            "margin_median": float(np.median(margins)) if margins else None,
            "beat_all": sum(m > 0 for m in margins),
            "counted": len(margins),
        }

    table = {name: stats(list(by_picture.values())) for name, by_picture in per_edit.items()}
    table["all"] = stats([c for by_picture in per_edit.values() for c in by_picture.values()])
    return table


def table(summary: dict) -> str:
    """The summary as a Markdown table (docs/EDITOR.md's per-instruction table)."""
    lines = [
        "| edit | median PSNR (dB) | median CIEDE2000 | median margin (dB) | beat every naive candidate |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in summary.items():
        margin = "n/a" if s["margin_median"] is None else f"{s['margin_median']:+.1f}"
        colour = "n/a" if s["delta_e_median"] is None else f"{s['delta_e_median']:.1f}"
        lines.append(f"| {name} | {s['psnr_median']:.1f} | {colour} | {margin} | {s['beat_all']} of {s['counted']} |")
    return "\n".join(lines)


def judge(cfg: TrainConfig, dit, codec, prompts, prompt_index: dict, device: torch.device, refs=None) -> dict:
    """The held-out measures: the VAE's round trip, and every edit per CFG scale (when a DiT was trained), as the
    training writes them to ``eval.json``; ``prompts``: the prompt table's embeddings and pooled embeddings;
    ``refs``: the held-out pictures when already loaded."""
    if refs is None:
        refs = reference_pictures(cfg.size, device, cfg.eval_pictures)
    embeds, pooled = prompts
    prompt_of = lambda text: (embeds[prompt_index[text]], pooled[prompt_index[text]])  # noqa: E731
    result = {
        "pictures": list(cfg.eval_pictures),
        "steps": cfg.eval_steps,
        "vae_roundtrip": roundtrip(codec, refs, cfg.eval_pictures),
        "edits": {},
        "summary": {},
    }
    result["edits"]["vae_ceiling"] = ceiling(codec, refs, cfg.eval_pictures)
    result["summary"]["vae_ceiling"] = summarize(result["edits"]["vae_ceiling"])
    for scale in cfg.eval_cfg_scales if cfg.dit_steps else ():
        per_edit = edits(dit, codec, refs, cfg.eval_pictures, prompt_of, scale, cfg.eval_steps, cfg.seed)
        result["edits"][f"true_cfg_scale={scale:g}"] = per_edit
        result["summary"][f"true_cfg_scale={scale:g}"] = summarize(per_edit)
    return result


def report(result: dict) -> None:
    """``judge``'s measures printed: the VAE's round trip, then one table per setting."""
    trip = result["vae_roundtrip"]
    each = ", ".join(f"{name} {r['psnr']:.1f}" for name, r in trip.items())
    print(f"vae round trip: median PSNR {np.median([r['psnr'] for r in trip.values()]):.2f} dB ({each})")
    for setting, summary in result["summary"].items():
        what = "the correct edits through the VAE and back" if setting == "vae_ceiling" else f"edits at {setting}"
        print(f"\n{what}, PSNR against the correct edit and margin over the naive candidates:")
        print(table(summary))


def judge_folder(folder, codec, names, size: int, device: torch.device, refs=None) -> dict:
    """A pipeline folder's held-out judgement, as the training writes it to ``eval.json``: its DiT as saved (bf16
    weights, where the training judged its fp32 EMA) and its VAE, run in fp32."""
    from ditrun.model.folders import model_text_len
    from recipes.editor.dit import make_dit, prompt_table

    text_len, _ = model_text_len(str(folder))  # where the recipe saved it, as a run reads it
    cfg = TrainConfig(size=size, eval_pictures=tuple(names), text_len=text_len)
    table, prompt_index = prompt_table(folder, text_len, device)
    dit = make_dit(device, str(folder)).eval().requires_grad_(False)
    return judge(cfg, dit, codec, table, prompt_index, device, refs)


def main(argv=None) -> None:
    """``python -m recipes.editor.evaluate [FOLDER]``: the VAE's round trip and ceiling of a pipeline folder (default:
    the committed editor) on the held-out pictures (``--pictures train``: the training pictures), on the CPU in
    fp32; ``--edits``: also its DiT's held-out judgement, as the training's ``eval.json`` holds it."""
    import argparse
    import json
    from pathlib import Path

    from ditrun.editor import FOLDER
    from recipes.editor.pictures import HELD_OUT, TRAIN
    from recipes.editor.vae import Codec, load_vae

    parser = argparse.ArgumentParser(prog="python -m recipes.editor.evaluate", description=main.__doc__)
    parser.add_argument("folder", nargs="?", type=Path, default=Path(FOLDER), help="a pipeline folder")
    parser.add_argument("--size", type=int, default=256, help="pixel size of the held-out pictures (default 256)")
    parser.add_argument("--json", type=Path, help="also write every picture's measures here")
    parser.add_argument(
        "--pictures",
        choices=("held-out", "train"),
        default="held-out",
        help="the held-out pictures (default), or the training pictures, to see what the VAE learnt of them",
    )
    parser.add_argument(
        "--poster-levels",
        help="also the ceiling of posterize at these levels per channel, comma-separated (e.g. 2,3,4,5)",
    )
    parser.add_argument(
        "--edits",
        action="store_true",
        help="also judge the folder's DiT on every instruction and picture as the training does (true CFG 1 and "
        "2.5, 8 steps; CPU ~7 min); --json then holds eval.json's form",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda, for --edits, fp32 on either (default cpu)")
    args = parser.parse_args(argv)
    try:
        levels = [int(x) for x in args.poster_levels.split(",")] if args.poster_levels else []
        wrong = any(count < 2 for count in levels)
    except ValueError:
        wrong = True
    if wrong:
        parser.error(f"--poster-levels {args.poster_levels}: each must be a whole number of at least 2, e.g. 2,3,4.")
    problem = device_problem(args.device)
    if problem:
        parser.error(problem)
    device = torch.device(args.device if args.edits else "cpu")
    codec = Codec(load_vae(args.folder / "vae", device))
    names = HELD_OUT if args.pictures == "held-out" else TRAIN
    refs = reference_pictures(args.size, device, names)
    if args.edits:
        record = judge_folder(args.folder, codec, names, args.size, device, refs)
    else:
        per_edit = ceiling(codec, refs, names)
        record = {"vae_roundtrip": roundtrip(codec, refs, names), "vae_ceiling": per_edit}
        record["summary"] = {"vae_ceiling": summarize(per_edit)}
    report(record)
    by_levels = posterize_levels(codec, refs, names, levels)
    if by_levels:
        print("\nposterize at other levels per channel: the input and the VAE's ceiling against the correct result")
        print("| levels | input, dB | ceiling, dB | ceiling's margin, dB (median, lowest) |\n| --- | --- | --- | --- |")
        for count, row in by_levels.items():
            print(
                f"| {count} | {row['input_psnr_median']:.1f} | {row['ceiling_psnr_median']:.1f} | "
                f"{row['ceiling_margin_median']:+.1f}, {row['ceiling_margin_min']:+.1f} |"
            )
    if args.json:
        record = {**record, "posterize_levels": by_levels}
        args.json.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
