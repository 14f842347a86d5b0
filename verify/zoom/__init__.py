"""Zoom: where inside the model a diverging step parts, module by module and then operation by
operation (verify/zoom/watch.py records; verify/zoom/locate.py judges and names)."""
