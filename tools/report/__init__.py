"""`agentlog report`: one self-contained HTML page that shows a run as pictures.

:mod:`tools.report.data` folds the log (lifecycle reducer + the sample
pipeline) into plain per-session and per-group data; :mod:`tools.report.render`
draws it with plotly (plotly.js inlined, so the page needs no network).
"""
