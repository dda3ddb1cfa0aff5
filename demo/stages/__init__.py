"""The stages of ``make demo`` (demo/run_demo.py), one module each: the shared names and
printer (common), the two ways to set the demo up (real_nodes, simulated), what it shows on top
(admission, alerts, serving, gateway). Imported as ``stages`` when run_demo.py runs as a script:
its folder is then first on ``sys.path``."""
