#!/usr/bin/env node
// A silod job client in Node.js: what a team that does not write Python needs to drive silod.
// It loads the contracts straight from protos/ at run time (@grpc/proto-loader), so there is no
// generated code to keep in step, and talks to the scheduler's JobService like `silod submit`,
// `silod watch` and `silod dataset list` do.
//
//   node silod-client.mjs [--scheduler HOST:PORT] [--token TOKEN] submit NAME [--gpus N]
//        [--samples N] [--batch-size N] [--step-compute-s S] [--dataset NAME] [--request-id ID]
//   node silod-client.mjs [...] watch JOB_ID        # one line per update, exit 0 iff SUCCEEDED
//   node silod-client.mjs [...] datasets            # one line per registered dataset
//
// Defaults: --scheduler from SILOD_SCHEDULER_ADDR (else 127.0.0.1:7071), --token from
// SILOD_AUTH_TOKEN, protos from SILOD_PROTOS (else ../../protos next to this file).
// Errors print the gRPC status code and message (which names the field) and exit 1.

import { fileURLToPath } from "node:url";
import path from "node:path";
import grpc from "@grpc/grpc-js";
import protoLoader from "@grpc/proto-loader";

const here = path.dirname(fileURLToPath(import.meta.url));

function usage(message) {
  if (message) console.error(`silod-node: ${message}`);
  console.error("usage: silod-client.mjs [--scheduler HOST:PORT] [--token TOKEN] " +
    "(submit NAME [--gpus N] [--samples N] [--batch-size N] [--step-compute-s S] [--dataset NAME] " +
    "[--request-id ID] | watch JOB_ID | datasets)");
  process.exit(2);
}

function parseArgs(argv) {
  const options = {};
  const positional = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i];
    if (arg.startsWith("--")) {
      const value = argv[i + 1];
      if (value === undefined) usage(`${arg} needs a value`);
      options[arg.slice(2)] = value;
      i++;
    } else {
      positional.push(arg);
    }
  }
  return { options, positional };
}

function positiveInt(options, name, fallback) {
  if (options[name] === undefined) return fallback;
  const value = Number(options[name]);
  if (!Number.isInteger(value) || value < 1) usage(`--${name}: expected a positive integer, got ${options[name]}`);
  return value;
}

function loadJobService(protoRoot, address, token) {
  const definition = protoLoader.loadSync("silod/v1/scheduler.proto", {
    includeDirs: [protoRoot],
    keepCase: true, // field names as in the .proto, like every other silod client
    longs: String,
    enums: String,
    defaults: true,
    oneofs: true,
  });
  const silod = grpc.loadPackageDefinition(definition).silod.v1;
  const callCredentials = grpc.credentials.createFromMetadataGenerator((_, callback) => {
    const metadata = new grpc.Metadata();
    if (token) metadata.add("authorization", `Bearer ${token}`);
    callback(null, metadata);
  });
  const credentials = token
    ? grpc.credentials.combineChannelCredentials(grpc.credentials.createInsecure(), callCredentials)
    : grpc.credentials.createInsecure();
  return new silod.JobService(address, credentials);
}

function fail(error) {
  const code = grpc.status[error.code] ?? error.code;
  console.error(`silod-node: ${code}: ${error.details ?? error.message}`);
  process.exit(1);
}

function unary(client, method, request, timeoutS = 30) {
  return new Promise((resolve, reject) => {
    const deadline = new Date(Date.now() + timeoutS * 1000);
    client[method](request, { deadline }, (error, response) => (error ? reject(error) : resolve(response)));
  });
}

function describe(job) {
  const progress = job.progress ?? {};
  return `${job.id} ${job.state} samples_done=${progress.samples_done ?? 0} message=${JSON.stringify(job.message ?? "")}`;
}

async function submit(client, name, options) {
  const gpus = positiveInt(options, "gpus", 1);
  const spec = {
    name,
    min_gpus: gpus,
    max_gpus: gpus,
    batch_size: positiveInt(options, "batch-size", 32),
    sample_budget: String(positiveInt(options, "samples", 1000)),
    emulated_step_compute_s: Number(options["step-compute-s"] ?? 0.01),
    dataset: options.dataset ?? "",
  };
  const job = await unary(client, "SubmitJob", { spec, client_request_id: options["request-id"] ?? "" });
  console.log(job.id);
}

function watch(client, jobId) {
  return new Promise((resolve, reject) => {
    let last = null;
    const call = client.WatchJob({ job_id: jobId });
    call.on("data", (update) => {
      last = update.job;
      const event = update.event ? ` event=${update.event.type}` : "";
      console.log(describe(update.job) + event);
    });
    call.on("error", reject);
    call.on("end", () => resolve(last));
  });
}

async function main() {
  const { options, positional } = parseArgs(process.argv.slice(2));
  const address = options.scheduler ?? process.env.SILOD_SCHEDULER_ADDR ?? "127.0.0.1:7071";
  const token = options.token ?? process.env.SILOD_AUTH_TOKEN ?? "";
  const protoRoot = process.env.SILOD_PROTOS ?? path.resolve(here, "..", "..", "protos");
  const [command, arg] = positional;
  const client = loadJobService(protoRoot, address, token);
  try {
    if (command === "submit") {
      if (!arg) usage("submit needs a job name");
      await submit(client, arg, options);
    } else if (command === "watch") {
      if (!arg) usage("watch needs a job id");
      const job = await watch(client, arg);
      process.exitCode = job && job.state === "JOB_STATE_SUCCEEDED" ? 0 : 1;
    } else if (command === "datasets") {
      const response = await unary(client, "ListDatasets", { page_size: 1000 });
      for (const d of response.datasets) {
        console.log(`${d.spec.name} ${d.spec.uri} objects=${d.num_objects} bytes=${d.total_bytes}`);
      }
    } else {
      usage(command ? `unknown command ${command}` : "no command");
    }
  } catch (error) {
    fail(error);
  } finally {
    client.close();
  }
}

main();
