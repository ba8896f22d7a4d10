"""`longft placement`'s flags --lora, --quantize and --optimizer: what each widens or pins in the
search (`cli.placement.tunings`), and the combinations it refuses with the fix."""

import pytest

from longft.cli.placement import tunings
from longft.config.params import from_dict
from longft.estimate.placement import Tuning


def test_flags_widen_the_search():
    cfg = from_dict({})
    assert tunings(cfg, None, None, None) == (Tuning(),)
    assert tunings(cfg, "any", None, None) == (Tuning(), Tuning(16))
    assert tunings(cfg, "8", "nf4", None) == (Tuning(8, "nf4"),)
    assert set(tunings(cfg, "any", "any", "any")) == {
        Tuning(0, "none", o) for o in ("adamw", "adamw_8bit")} | {
        Tuning(16, q, o) for q in ("none", "nf4", "int8") for o in ("adamw", "adamw_8bit")}
    lora = from_dict({"lora": {"rank": 32, "quantize": "nf4"}, "optim": {"name": "adamw_8bit"},
                     "zero": {"stage": 2, "offload_optimizer": "none"}})
    assert tunings(lora, "any", None, None)[0] == Tuning(32, "nf4", "adamw_8bit")  # its own first
    for q in ("nf4", "any"):   # any too: it was silently ignored ("searched: full-parameter")
        with pytest.raises(ValueError, match=f"--quantize {q} quantizes .* add --lora RANK"):
            tunings(cfg, None, q, None)
        with pytest.raises(ValueError, match="add --lora RANK"):
            tunings(cfg, "none", q, None)
    assert tunings(cfg, None, "none", None) == (Tuning(),)
    with pytest.raises(ValueError, match="--lora 'x'"):
        tunings(cfg, "x", None, None)
