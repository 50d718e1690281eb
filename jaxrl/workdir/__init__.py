"""The files a run keeps in its workdir: checkpoints, the metric writers, the run log, the compile
cache and profiler traces. Nothing here knows the training loop; ``jaxrl.run`` drives these."""
