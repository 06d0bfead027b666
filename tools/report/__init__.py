"""`agentlog report`: one self-contained HTML page that shows a run as pictures.

:mod:`tools.report.data` folds the log in one streaming pass (lifecycle fold
+ the sample pipeline) into fixed-size aggregates (:mod:`tools.report.aggregates`)
and a bounded sessions table (:mod:`tools.report.session_table`);
:mod:`tools.report.render` draws them with plotly (plotly.js inlined,
so the page needs no network). The page's size does not grow with the
number of sessions; the full per-session timeline is ``agentlog trace``
(:mod:`tools.cmd_trace`).
"""
