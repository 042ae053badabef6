package gograph

// Pass records: one per graphed pass, holding its graphs and pool
// references, with the capture transaction (two calls per capture) that
// attaches them. The rules are internal/state's; see its capture.go.

import "github.com/gograph/gograph/internal/state"

// NewPass creates the record of graphed callable callableIndex, in state
// "building", and returns its id.
func NewPass(callableIndex int, label string) (pass int64, err error) {
	defer recoverPanic("new_pass", &err)
	return passes.NewPass(callableIndex, label)
}

// BeginPassCapture opens the capture of pass's kind (0 forward, 1 backward,
// 2 wgrad) in the memory pool named pool (equal for captures that share a
// pool) on stream in mode (0 global, 1 thread_local, 2 relaxed); stream 0
// captures nothing (the eager engine). On success the pass holds one more
// reference on pool; on failure nothing changed.
func BeginPassCapture(pass int64, kind int, pool string, stream int64, mode int) (ok bool, err error) {
	defer recoverPanic("begin_pass_capture", &err)
	return done(opErr("begin_pass_capture", passes.BeginCapture(pass, state.GraphKind(kind), pool, stream, mode)))
}

// EndPassCapture ends pass's open capture of kind on stream, instantiates
// and attaches the graph and returns the capture's sequence number in its
// pool (from 1). On failure the driver's result is destroyed and nothing is
// attached; the pool reference stays with the pass.
func EndPassCapture(pass int64, kind int, stream int64) (seq int, err error) {
	defer recoverPanic("end_pass_capture", &err)
	seq, err = passes.EndCapture(pass, state.GraphKind(kind), stream)
	return seq, opErr("end_pass_capture", err)
}

// AbortPassCapture closes pass's open capture of kind after the captured
// work failed (ending the stream's capture, destroying its result). The pool
// reference stays with the pass. Harmless when nothing is open.
func AbortPassCapture(pass int64, kind int, stream int64) (ok bool, err error) {
	defer recoverPanic("abort_pass_capture", &err)
	return done(opErr("abort_pass_capture", passes.AbortCapture(pass, state.GraphKind(kind), stream)))
}

// SealPass moves pass from "building" to "ready".
func SealPass(pass int64) (ok bool, err error) {
	defer recoverPanic("seal_pass", &err)
	return done(passes.Seal(pass))
}

// Replay launches pass's graph of kind on stream: the replay hot path. It
// returns whether a graph was launched (false for a kind captured on stream
// 0, the eager engine). It returns a bool so that gopy's wrapper does not
// leak a string on every call.
func Replay(pass int64, kind int, stream int64) (launched bool, err error) {
	defer recoverPanic("replay", &err)
	return passes.Replay(pass, state.GraphKind(kind), stream)
}

// OrderReplay orders stream for pass's next replay of kind without
// launching (see the cudagraph registry's Order): an RNG companion's writes
// enqueued next on stream then run after the previous replay of the graphs
// sharing its capture stream. It returns whether there was a graph to order
// (false for the eager engine, or a pass that cannot replay kind: the
// replay reports why).
func OrderReplay(pass int64, kind int, stream int64) (ordered bool, err error) {
	defer recoverPanic("order_replay", &err)
	return passes.Order(pass, state.GraphKind(kind), stream)
}

// PassState returns "building", "ready" or "reset".
func PassState(pass int64) (s string, err error) {
	defer recoverPanic("pass_state", &err)
	life, err := passes.State(pass)
	if err != nil {
		return "", err
	}
	return life.String(), nil
}

// PassGraph returns the graph handle pass holds for kind (0 if none, eager
// or reset).
func PassGraph(pass int64, kind int) (graph int64, err error) {
	defer recoverPanic("pass_graph", &err)
	return passes.Graph(pass, state.GraphKind(kind))
}

// ResetPass destroys every graph pass owns (aborting a capture left open),
// moves it to "reset" and returns how many pool references the caller must
// now release; a second call returns 0. A graph that fails to be destroyed
// does not stop the reset (the others are destroyed, the references still
// returned): its error is kept for PassResetError, so that the count is
// never lost to an exception.
func ResetPass(pass int64) (refs int, err error) {
	defer recoverPanic("reset_pass", &err)
	refs, err = passes.ResetPass(pass)
	if err != nil {
		if _, known := passes.State(pass); known == nil {
			return refs, nil // reset, with the error kept on the record
		}
	}
	return refs, err
}

// PassResetError returns why pass's last reset failed to destroy a graph, or
// "" when it did not fail.
func PassResetError(pass int64) (msg string, err error) {
	defer recoverPanic("pass_reset_error", &err)
	return passes.ResetError(pass)
}

// DropPass resets pass if needed and forgets it; an unknown id is not an
// error. It returns the pool references that reset handed back (release
// them), 0 when the pass was reset before. Reset first to learn whether a
// graph failed to be destroyed: a dropped record cannot be asked.
func DropPass(pass int64) (refs int, err error) {
	defer recoverPanic("drop_pass", &err)
	refs, _ = passes.DropPass(pass) // the record is gone either way
	return refs, nil
}

// PoolRefs returns how many references the live passes hold on pool: what
// the allocator must still be holding for them (leak checks, reports).
func PoolRefs(pool string) int { return passes.PoolRefs(pool) }

// LivePasses returns how many pass records exist (not dropped).
func LivePasses() int { return passes.LivePasses() }
