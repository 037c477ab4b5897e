"""The self-check's filter of SGLang's known start-up messages: exactly those are dropped (and
listed with their reason), everything else still reaches the user. Runs in a subprocess: the
filter patches this process's warnings and logging."""

from __future__ import annotations

import subprocess
import sys

CODE = r'''
import logging, sys, warnings
from k3nvfp4.sglang_ext.model_check import noise
noise.install()
warnings.warn("Only CUDA, HIP and XPU support AWQ currently.")
warnings.warn("something else entirely")
log = logging.getLogger("sglang.srt.model_loader")
h = logging.StreamHandler(sys.stderr)
log.addHandler(h)  # added after install(): SGLang configures its handlers late
log.warning("K3 fused KDA decode disabled: unexpected conv/A_log/dt_bias layout (conv (144, 4))")
log.warning("Ignore import error when loading sglang.srt.models.falcon_mamba: cannot import name 'causal_conv1d_fn' from x")
log.warning("a real problem the user must see")
print(noise.seen())
print("\n".join(noise.explain(noise.seen())))
'''


def test_known_sglang_messages_are_filtered_and_explained():
    proc = subprocess.run([sys.executable, "-P", "-c", CODE], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    err, out = proc.stderr, proc.stdout
    assert "something else entirely" in err and "a real problem the user must see" in err
    assert "AWQ" not in err and "KDA" not in err and "causal_conv1d_fn" not in err
    assert "['Ignore import error ... causal_conv1d_fn', 'K3 fused KDA decode disabled', " \
           "'Only CUDA ... support AWQ / GGUF']" in out
    assert '"K3 fused KDA decode disabled": SGLang\'s fused KDA decode needs K3\'s real head sizes' in out
