# Usage: python evaluation/results/smollm2-cpu/draft-vocab-size/make_variants.py OUT (default runs/vocab).
# Variants of dflash-gpu-cont3 with larger draft vocabularies: the shipped map plus the next most frequent tokens of
# the shipped training responses (the head is the target's frozen LM head, so its rows exist for every token).
import glob, json, shutil, sys
import numpy as np, pandas as pd, torch
from safetensors.torch import load_file, save_file
S = "hub/embedded/smollm2-135m-instruct"
src = f"{S}/dflash-gpu-cont3"
OUT = sys.argv[1] if len(sys.argv) > 1 else "runs/vocab"
sd = load_file(f"{src}/model.safetensors")
shipped = sd["draft_token_ids"]
V = 49152
counts = np.zeros(V, dtype=np.int64)
for f in sorted(glob.glob(f"{S}/data*/shard-*.parquet")):
    df = pd.read_parquet(f, columns=["input_ids", "loss_mask"])
    for ids, m in zip(df.input_ids, df.loss_mask):
        ids = np.asarray(ids); counts += np.bincount(ids[np.asarray(m).astype(bool)], minlength=V)
prio = counts.copy(); prio[shipped.numpy()] = counts.sum() + 1
order = np.argsort(-prio, kind="stable")
for size in (16384, 32768, None):
    out = f"{OUT}/cont3-v{size or 'full'}"
    shutil.copytree(src, out, dirs_exist_ok=True)
    cfg = json.load(open(f"{out}/config.json")); cfg["draft_vocab_size"] = size
    json.dump(cfg, open(f"{out}/config.json", "w"), indent=2)
    new = dict(sd)
    if size is None: new.pop("draft_token_ids")
    else: new["draft_token_ids"] = torch.as_tensor(np.sort(order[:size]))
    save_file(new, f"{out}/model.safetensors", metadata={"format": "pt"})
    print(out, size, counts[order[:size or V]].sum() / counts.sum())
print("shipped", counts[shipped.numpy()].sum() / counts.sum())
