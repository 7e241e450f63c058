// Command play plays full episodes of echo or an OpenSpiel game against an openenv-grpc
// server and prints one JSON summary line on stdout (progress goes to stderr). It is the
// Go twin of clients/node/play.js and prints the same summary.
//
//	play --target 127.0.0.1:50051 --env echo
//	play --target 127.0.0.1:50051 --env openspiel --game tic_tac_toe
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"openenvgrpc/client/session"
	pb "openenvgrpc/gen/openenv_grpc/v1"
	echov1 "openenvgrpc/gen/openenv_grpc_envs/echo/v1"
	openspielv1 "openenvgrpc/gen/openenv_grpc_envs/openspiel/v1"
)

type inBandError struct {
	When     string `json:"when"`
	Code     int    `json:"code"`
	CodeName string `json:"code_name"`
	Message  string `json:"message"`
}

type episode struct {
	EpisodeID      string    `json:"episode_id"`
	Steps          uint64    `json:"steps"`
	Reward         float64   `json:"reward"`
	Terminated     bool      `json:"terminated"`
	Truncated      bool      `json:"truncated"`
	Returns        []float64 `json:"returns,omitempty"`
	StateStepCount uint64    `json:"state_step_count"`
	StateOK        bool      `json:"state_ok"`
	Game           string    `json:"game,omitempty"`
	BoardOK        *bool     `json:"board_ok,omitempty"`
}

type capacity struct {
	Refusals   int   `json:"refusals"`
	PushbackMs []int `json:"pushback_ms"`
	Admitted   bool  `json:"admitted"`
}

type summary struct {
	Client           string        `json:"client"`
	Env              string        `json:"env"`
	EnvName          string        `json:"env_name"`
	SessionID        string        `json:"session_id"`
	Capacity         capacity      `json:"capacity"`
	Errors           []inBandError `json:"errors"`
	Episodes         []episode     `json:"episodes"`
	EpisodesFinished int           `json:"episodes_finished"`
	Closed           bool          `json:"closed"`
	Failure          string        `json:"failure,omitempty"`
}

type options struct {
	target, env, game           string
	episodes, maxSteps, retries int
	seed                        int64
}

func logf(format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "play: "+format+"\n", args...)
}

// expectError runs a request that must fail in-band and returns the error it got.
func expectError(when string, request func() (*pb.StepResult, error)) (inBandError, error) {
	_, err := request()
	var envErr *session.EnvError
	if err == nil {
		return inBandError{}, fmt.Errorf("%s: expected an in-band error, the request succeeded", when)
	}
	if !errors.As(err, &envErr) {
		return inBandError{}, err
	}
	logf("%s: in-band error %s (%d): %s", when, codeName(envErr), int(envErr.Code), envErr.Message)
	return inBandError{when, int(envErr.Code), codeName(envErr), envErr.Message}, nil
}

// codeName is the canonical upper-case name, e.g. FAILED_PRECONDITION, as in the Node summary.
func codeName(e *session.EnvError) string {
	names := map[int]string{
		0: "OK", 1: "CANCELLED", 2: "UNKNOWN", 3: "INVALID_ARGUMENT", 4: "DEADLINE_EXCEEDED",
		5: "NOT_FOUND", 6: "ALREADY_EXISTS", 7: "PERMISSION_DENIED", 8: "RESOURCE_EXHAUSTED",
		9: "FAILED_PRECONDITION", 10: "ABORTED", 11: "OUT_OF_RANGE", 12: "UNIMPLEMENTED",
		13: "INTERNAL", 14: "UNAVAILABLE", 15: "DATA_LOSS", 16: "UNAUTHENTICATED",
	}
	if name, ok := names[int(e.Code)]; ok {
		return name
	}
	return fmt.Sprint(int(e.Code))
}

// playEcho: each episode is truncated after maxSteps; the state's total_length is checked.
func playEcho(s *session.Session, o options, sum *summary) error {
	e, err := expectError("step before reset", func() (*pb.StepResult, error) {
		return s.Step(&echov1.EchoAction{Kind: &echov1.EchoAction_Message{Message: "too early"}})
	})
	if err != nil {
		return err
	}
	sum.Errors = append(sum.Errors, e)
	for i := 0; i < o.episodes; i++ {
		seed := o.seed + int64(i)
		result, err := s.Reset(seed, &echov1.EchoResetOptions{MaxSteps: uint32(o.maxSteps)})
		if err != nil {
			return err
		}
		var totalLength uint64
		reward := 0.0
		for !result.Terminated && !result.Truncated {
			message := fmt.Sprintf("episode %d step %d", i, result.StepCount+1)
			result, err = s.Step(&echov1.EchoAction{Kind: &echov1.EchoAction_Message{Message: message}})
			if err != nil {
				return err
			}
			var obs echov1.EchoObservation
			if err := result.Observation.UnmarshalTo(&obs); err != nil {
				return err
			}
			if obs.EchoedMessage != message {
				return fmt.Errorf("echo mismatch: %q", obs.EchoedMessage)
			}
			totalLength += uint64(utf8.RuneCountInString(message))
			reward += result.Reward
		}
		st, err := s.State()
		if err != nil {
			return err
		}
		var state echov1.EchoState
		if err := st.State.UnmarshalTo(&state); err != nil {
			return err
		}
		sum.Episodes = append(sum.Episodes, episode{
			EpisodeID: result.EpisodeId, Steps: result.StepCount, Reward: reward,
			Terminated: result.Terminated, Truncated: result.Truncated,
			StateStepCount: st.StepCount,
			StateOK:        state.TotalLength == totalLength && state.Seed == uint64(seed),
		})
		if i == 0 {
			e, err := expectError("step after truncation", func() (*pb.StepResult, error) {
				return s.Step(&echov1.EchoAction{Kind: &echov1.EchoAction_Message{Message: "late"}})
			})
			if err != nil {
				return err
			}
			sum.Errors = append(sum.Errors, e)
		}
	}
	return nil
}

// xorshift32, the same generator as the Node client's, so both pick alike.
type xorshift struct{ x uint32 }

func (r *xorshift) pick(n int) int {
	r.x ^= r.x << 13
	r.x ^= r.x >> 17
	r.x ^= r.x << 5
	return int(r.x % uint32(n))
}

// illegalID is the smallest non-negative id not among the legal ones.
func illegalID(legal []*openspielv1.LegalAction) int64 {
	ids := map[int64]bool{}
	for _, a := range legal {
		ids[a.Id] = true
	}
	id := int64(0)
	for ids[id] {
		id++
	}
	return id
}

func spielAction(id int64) proto.Message {
	return &openspielv1.OpenSpielAction{Action: &openspielv1.OpenSpielAction_Id{Id: id}}
}

// playOpenSpiel: the agent (seat 0) picks seeded-random legal actions against random opponents.
func playOpenSpiel(s *session.Session, o options, sum *summary) error {
	e, err := expectError("step before reset", func() (*pb.StepResult, error) {
		return s.Step(spielAction(0))
	})
	if err != nil {
		return err
	}
	sum.Errors = append(sum.Errors, e)
	rng := &xorshift{uint32(o.seed)}
	if rng.x == 0 {
		rng.x = 0x9e3779b9
	}
	for i := 0; i < o.episodes; i++ {
		result, err := s.Reset(o.seed+int64(i), &openspielv1.OpenSpielResetOptions{Game: o.game})
		if err != nil {
			return err
		}
		var obs openspielv1.OpenSpielObservation
		if err := result.Observation.UnmarshalTo(&obs); err != nil {
			return err
		}
		if i == 0 {
			bad := illegalID(obs.LegalActions)
			e, err := expectError(fmt.Sprintf("illegal action id %d", bad), func() (*pb.StepResult, error) {
				return s.Step(spielAction(bad))
			})
			if err != nil {
				return err
			}
			sum.Errors = append(sum.Errors, e)
		}
		reward := 0.0
		for !result.Terminated && !result.Truncated {
			if len(obs.LegalActions) == 0 {
				return errors.New("no legal action in a running episode")
			}
			result, err = s.Step(spielAction(obs.LegalActions[rng.pick(len(obs.LegalActions))].Id))
			if err != nil {
				return err
			}
			if err := result.Observation.UnmarshalTo(&obs); err != nil {
				return err
			}
			reward += result.Reward
		}
		st, err := s.State()
		if err != nil {
			return err
		}
		var state openspielv1.OpenSpielState
		if err := st.State.UnmarshalTo(&state); err != nil {
			return err
		}
		rendered, err := s.Render()
		if err != nil {
			return err
		}
		board := rendered.GetFrame().GetText()
		boardOK := board != "" && board == state.StateString
		sum.Episodes = append(sum.Episodes, episode{
			EpisodeID: result.EpisodeId, Steps: result.StepCount, Reward: reward,
			Terminated: result.Terminated, Truncated: result.Truncated, Returns: obs.Returns,
			StateStepCount: st.StepCount, StateOK: state.Terminal == obs.Terminal && state.Game != "",
			Game: state.Game, BoardOK: &boardOK,
		})
	}
	return nil
}

func run(o options, sum *summary) error {
	conn, err := session.Dial(o.target)
	if err != nil {
		return err
	}
	defer conn.Close()
	client := pb.NewEnvServiceClient(conn)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	info, err := client.Info(ctx, &pb.InfoRequest{})
	cancel()
	if err != nil {
		return err
	}
	sum.EnvName = info.EnvName
	s, err := session.OpenWithRetry(context.Background(), client, o.retries, 500*time.Millisecond,
		func(e *session.CapacityError, attempt int) {
			sum.Capacity.Refusals++
			sum.Capacity.PushbackMs = append(sum.Capacity.PushbackMs, e.PushbackMs)
			logf("open refused (attempt %d): %v; retrying in %d ms", attempt, e, e.PushbackMs)
		})
	if err != nil {
		return err
	}
	defer s.Abandon()
	sum.Capacity.Admitted = true
	sum.SessionID = s.ID
	logf("session %s open on %s", s.ID, info.EnvName)
	play := playEcho
	if o.env == "openspiel" {
		play = playOpenSpiel
	}
	if err := play(s, o, sum); err != nil {
		return err
	}
	if err := s.Close(); err != nil {
		return err
	}
	sum.Closed = true
	return nil
}

func main() {
	var o options
	flag.StringVar(&o.target, "target", "", "server address HOST:PORT (required)")
	flag.StringVar(&o.env, "env", "", "echo or openspiel (required)")
	flag.IntVar(&o.episodes, "episodes", 2, "episodes to play")
	flag.IntVar(&o.maxSteps, "max-steps", 3, "echo: EchoResetOptions.max_steps")
	flag.StringVar(&o.game, "game", "tic_tac_toe", "openspiel: the game")
	flag.Int64Var(&o.seed, "seed", 1, "first episode's seed; episode i uses seed+i")
	flag.IntVar(&o.retries, "open-retries", 20, "retries of a refused open while the server is full")
	flag.Parse()
	if o.target == "" || (o.env != "echo" && o.env != "openspiel") {
		flag.Usage()
		os.Exit(2)
	}
	sum := summary{Client: "go", Env: o.env, Errors: []inBandError{}, Episodes: []episode{},
		Capacity: capacity{PushbackMs: []int{}}}
	exit := 0
	if err := run(o, &sum); err != nil {
		sum.Failure = err.Error()
		exit = 1
	}
	for _, e := range sum.Episodes {
		if e.Terminated || e.Truncated {
			sum.EpisodesFinished++
		}
	}
	line, _ := json.Marshal(sum)
	fmt.Println(string(line))
	os.Exit(exit)
}
