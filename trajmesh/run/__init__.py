"""Run tooling (the top layer: services never import it):

    cli.py          the `trajmesh` command line
    train.py        `trajmesh train`: prepare, evaluate, run the mesh, evaluate again, summarize
    launcher.py     the whole mesh as local processes   run_end.py how a local run stops, nothing lost
    sweep.py        factorial experiments               profile.py difficulty profiling
    audit.py        the verifier audit before a run     manifest.py the run manifest
    inspect.py      what a run trained on, from its files   plot.py a run's PNG
    doctor.py       checks a Kubernetes cluster for the chart
    model_import.py a GGUF file or package as a Hugging Face model directory
    judge_engine.py the judge engine a run starts itself (judged sources without judge.urls)
"""
