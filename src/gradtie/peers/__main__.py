"""`python -m gradtie.peers '<json>'`: one peer timed in this process (`gradtie.peers.child`)."""

from .child import main

raise SystemExit(main())
