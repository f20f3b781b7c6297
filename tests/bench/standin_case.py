"""``StandinTestCase``: a test case whose tests run as rank 0 of stand-in groups (``relay_compile.bench``).

The stand-in world is torn down after each class, so other tests never see torch.distributed initialized.
torch.distributed's deprecation warnings (FutureWarning, printed on collectives the ring and the references
use) are hidden inside each test; the warning filters are restored after it.
"""

from __future__ import annotations

import unittest
import warnings

from relay_compile.bench import destroy_standin_groups


class StandinTestCase(unittest.TestCase):
    def setUp(self) -> None:
        super().setUp()
        filters = warnings.catch_warnings()
        filters.__enter__()
        self.addCleanup(filters.__exit__, None, None, None)
        warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

    @classmethod
    def tearDownClass(cls) -> None:
        destroy_standin_groups()
        super().tearDownClass()
