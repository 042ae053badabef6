package gograph

// The replay-order guard's exported surface: capture sequence numbers per
// pool (given by EndPassCapture) and the opt-in check, in Replay, that graphs
// sharing a pool replay in an order that cannot overwrite memory another pass
// still needs. The rule is
// documented in internal/state/order.go and docs/DESIGN.md; the contract in
// docs/CORE_API.md.

import (
	"fmt"
	"strings"

	"github.com/gograph/gograph/internal/state"
)

// CaptureSeq returns the capture sequence number of pass's kind in its pool
// (0 when that kind's capture was not recorded).
func CaptureSeq(pass int64, kind int) (seq int, err error) {
	defer recoverPanic("capture_seq", &err)
	seq, _, err = passes.CaptureSeq(pass, state.GraphKind(kind))
	return seq, err
}

// PassPool returns the pool key pass's captures were recorded in ("" when
// none was recorded).
func PassPool(pass int64) (pool string, err error) {
	defer recoverPanic("pass_pool", &err)
	_, pool, err = passes.CaptureSeq(pass, state.Forward)
	return pool, err
}

// SetReplayOrderCheck turns the replay-order guard on or off for pass. On
// needs a recorded capture and a pass that is not reset; off is always
// allowed and closes the pass if it was open. It returns on.
func SetReplayOrderCheck(pass int64, on bool) (enabled bool, err error) {
	defer recoverPanic("set_replay_order_check", &err)
	if err := passes.SetOrderCheck(pass, on); err != nil {
		return false, err
	}
	return on, nil
}

// CheckReplayOrder returns the error Replay would raise for pass's kind under
// the replay-order guard, without replaying or changing anything, and true
// when the replay would be allowed. Python calls it before copying arguments
// into static buffers, so a refused replay leaves them untouched. A
// per-iteration call in debug mode, so it returns a bool.
func CheckReplayOrder(pass int64, kind int) (ok bool, err error) {
	defer recoverPanic("check_replay_order", &err)
	if err := passes.CheckOrder(pass, state.GraphKind(kind)); err != nil {
		return false, err
	}
	return true, nil
}

// ReplayOrderCheck reports whether the replay-order guard is on for pass.
func ReplayOrderCheck(pass int64) (on bool, err error) {
	defer recoverPanic("replay_order_check", &err)
	p, err := passes.Snapshot(pass)
	return p.CheckOrder, err
}

// DiscardReplayOrder closes pass if the guard holds it open (its pending
// kinds will not run: a forward replayed where no backward can follow) and
// reports whether it was open. A per-iteration call in debug mode, so it
// returns a bool (gopy's error-only wrappers leak a string per call).
func DiscardReplayOrder(pass int64) (wasOpen bool, err error) {
	defer recoverPanic("discard_replay_order", &err)
	return passes.DiscardOpen(pass)
}

// ReplayOrderState describes the guarded passes of pool that are open (their
// first kind replayed, later kinds pending), one per line; "" when none.
func ReplayOrderState(pool string) (s string, err error) {
	defer recoverPanic("replay_order_state", &err)
	return passes.OrderState(pool), nil
}

// SetReplayRecarveSpec gives the debug-mode checker what pass's kind graph
// writes and reads in its pool at every replay (internal/recarve.ParseSpec's
// text: "name TEXT", "w START END", "r START END PASS KIND TEXT"). A guarded
// graph with a spec is checked precisely, instead of by the capture-order
// rule: any replay order passes unless the graph would overwrite memory
// holding another graph's content a later replay still reads, or read
// content another graph overwrote.
func SetReplayRecarveSpec(pass int64, kind int, spec string) (ok bool, err error) {
	defer recoverPanic("set_replay_recarve_spec", &err)
	if err := passes.SetRecarveSpec(pass, state.GraphKind(kind), spec); err != nil {
		return false, err
	}
	return true, nil
}

// ReplayClobbers lists, one per line as "PASS KIND INDEX MESSAGE", the
// pool-planned buffers other graphs handed to the caller (spec lines
// "h START END INDEX TEXT") that replaying pass's kind graph overwrites:
// the executor makes a read of each such tensor it still holds raise
// MESSAGE. "" when there are none or the checker does not know the graph.
func ReplayClobbers(pass int64, kind int) (lines string, err error) {
	defer recoverPanic("replay_clobbers", &err)
	cs, err := passes.RecarveClobbers(pass, state.GraphKind(kind))
	if err != nil {
		return "", err
	}
	var b strings.Builder
	for _, c := range cs {
		fmt.Fprintf(&b, "%d %d %d %s\n", c.Owner.Pass, c.Owner.Kind, c.Index, c.Message)
	}
	return b.String(), nil
}
