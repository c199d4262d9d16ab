"""Course tools: the notebook generator (:mod:`.authoring`), the grader
(:mod:`.grade`) and the ``gpulab`` command (:mod:`.cli`)."""
