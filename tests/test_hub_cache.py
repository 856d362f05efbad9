"""tools/hub_cache.py lays a model folder into the hub cache as huggingface_hub lays it out: huggingface_hub's own
offline lookup finds it under the hub name, and tunebook loads it by that name."""
import importlib.util
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hub_cache", ROOT / "tools" / "hub_cache.py")
hub_cache = importlib.util.module_from_spec(spec); spec.loader.exec_module(hub_cache)


def test_laid_model_resolves_offline_by_its_hub_name(tmp_path, make_hf):
    hf, folder = make_hf("llama")
    hub = tmp_path / "hub"
    assert hub_cache.cached(hub, "acme/tiny") is None
    snap = hub_cache.lay(folder, hub, "acme/tiny")
    assert hub_cache.lay(folder, hub, "acme/tiny") == snap == hub_cache.cached(hub, "acme/tiny")   # laying again changes nothing
    found = Path(snapshot_download("acme/tiny", cache_dir=hub, local_files_only=True))   # huggingface_hub's own lookup
    assert found == snap and (found / "config.json").read_bytes() == (folder / "config.json").read_bytes()
    from tunebook.checkpoint import load_hf
    model = load_hf(found, dtype=torch.float32)
    ids = torch.randint(0, hf.config.vocab_size, (1, 7))
    with torch.no_grad(): torch.testing.assert_close(model(ids), hf.eval()(ids).logits, rtol=1e-5, atol=1e-5)
