"""``dimuon plan``: a training step on a GPU cluster predicted from the census's counts. It counts with
``dimuon.bench.census`` and builds models as ``dimuon.groups`` does; nothing below imports it."""
