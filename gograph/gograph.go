// Package gograph is the Go core's exported surface, compiled by gopy into
// the Python extensions gograph._core_cpu and gograph._core_cuda. Its exact
// contract is docs/CORE_API.md; its typed Python stub is
// python/gograph/core/_core.pyi.
//
// The package is deliberately thin, one file per topic: info.go (build and
// driver information), capture.go (the raw capture engine), pass.go (pass
// records and the capture transaction), plan.go (schedules and memory
// plans, held by handle), guard.go (capture order and the replay-order
// guard) and gradslot.go (the grad-slot policy). The logic lives in
// internal/cudagraph (driver calls and the graph registry), internal/state
// (the pass ledger), internal/schedule, internal/lifetime (the build
// planner), internal/plans and internal/gradslot. What this package adds is
// the boundary discipline gopy needs:
//
//   - only int, int64, string, bool and error cross (gopy cannot take Python
//     lists or dicts, and handles are plain integers);
//   - a Go panic would abort the Python interpreter, so every function that
//     returns an error starts with `defer recoverPanic(...)`, which turns a
//     panic into a returned error (a Python RuntimeError); functions without
//     an error result are kept trivially panic-free;
//   - no exported variables or types, so gopy generates nothing but these
//     functions;
//   - no function has an error as its only result: gopy v0.4.10's wrapper of
//     that shape returns a C string it never frees (the empty string on
//     success, the message on failure: 30-50 bytes lost per call, measured),
//     so such functions return (ok bool, err error) instead, which frees
//     everything. hardening_test.go checks both rules for every export.
package gograph

import (
	"fmt"

	"github.com/gograph/gograph/internal/cudagraph"
	"github.com/gograph/gograph/internal/plans"
	"github.com/gograph/gograph/internal/state"
)

// coreVersion is the semver of the core; Python checks it against its own.
const coreVersion = "0.3.0"

// The process-wide registries (the extension is loaded once per
// interpreter): the graph registry over this build's driver, the ledger of
// passes that captures, launches and frees through it, and the plans of the
// builds underway.
var (
	graphs = cudagraph.NewRegistry(cudagraph.NewDriver())
	passes = state.NewLedger(graphs)
	store  = plans.NewStore()
)

// recoverPanic turns a panic in the exported function name into its returned
// error. It must be deferred directly (recover only works there).
func recoverPanic(name string, err *error) {
	if r := recover(); r != nil {
		*err = fmt.Errorf("%s: internal panic: %v", name, r)
	}
}

// done is the (ok, err) result of an operation that yields nothing but an
// error (see the package doc: no export returns an error alone).
func done(err error) (bool, error) { return err == nil, err }

// opErr prefixes an error with the Python name of the function that made it.
func opErr(name string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("%s: %w", name, err)
}
