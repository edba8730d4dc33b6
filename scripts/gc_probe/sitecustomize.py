"""Device experiment (scripts/gpu_gc_probe.sh), as the path's first sitecustomize, so every Python process started
(the ranks, their DataLoader workers) takes it: GPUFEED_PROBE_GC=off runs without the cyclic garbage collector
(no collection pauses a rank's thread mid-step); GPUFEED_PROBE_SWITCH=S sets the interpreter's thread switch
interval to S seconds (default 0.005: how long another thread may keep the GIL from a rank's launching thread)."""
import gc
import os
import sys

if os.environ.get("GPUFEED_PROBE_GC") == "off":
    gc.disable()
if os.environ.get("GPUFEED_PROBE_SWITCH"):
    sys.setswitchinterval(float(os.environ["GPUFEED_PROBE_SWITCH"]))
