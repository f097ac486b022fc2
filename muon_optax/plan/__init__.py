"""The static plan: who owns which matrix on how many devices, how each is moved, the
layouts and the state's layout. Numbers only, nothing traced."""
