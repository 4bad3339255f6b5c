"""Field lists of KubeRay's ``ray.io/v1`` CRDs, cut to the objects deploy/kuberay/ uses (for
tests/deploy/test_manifests.py; no behaviour of its own).

Source: ray-project/kuberay v1.7.0 (commit 59d663aeec13760646da3db9c1cf8cfe883e30b7),
``ray-operator/config/crd/bases/ray.io_rayclusters.yaml`` and ``ray.io_rayjobs.yaml``, version ``v1``,
``openAPIV3Schema``. RayJob's ``spec.rayClusterSpec`` is the same schema as RayCluster's ``spec`` (checked
when these lists were cut), and the head and worker groups' ``template`` is the same Kubernetes
PodTemplateSpec, so both are listed once (``RayCluster.spec``, ``PodTemplateSpec``).

Each entry: an object's dotted path (``[]`` for list items) -> ``fields`` (every field the CRD accepts
there, space separated), ``required``, ``types`` (of the fields our manifests use: string, integer,
boolean, object, array, int-or-string) and ``enums``; or ``map`` (an object of free keys whose values have
that type, e.g. labels, rayStartParams). A manifest object not listed here fails the test: cut the list
again from the CRD when a manifest starts using a new object.
"""

FIELDS = \
{'PodTemplateSpec': {'fields': 'metadata spec', 'types': {'metadata': 'object', 'spec': 'object'}},
 'PodTemplateSpec.metadata': {'fields': 'annotations finalizers labels name namespace',
                              'types': {'labels': 'object'}},
 'PodTemplateSpec.metadata.labels': {'map': 'string'},
 'PodTemplateSpec.spec': {'fields': 'activeDeadlineSeconds affinity automountServiceAccountToken '
                                    'containers dnsConfig dnsPolicy enableServiceLinks ephemeralContainers '
                                    'hostAliases hostIPC hostNetwork hostPID hostUsers hostname '
                                    'hostnameOverride imagePullSecrets initContainers nodeName '
                                    'nodeSelector os overhead preemptionPolicy priority priorityClassName '
                                    'readinessGates resourceClaims resources restartPolicy '
                                    'runtimeClassName schedulerName schedulingGates schedulingGroup '
                                    'securityContext serviceAccount serviceAccountName setHostnameAsFQDN '
                                    'shareProcessNamespace subdomain terminationGracePeriodSeconds '
                                    'tolerations topologySpreadConstraints volumes',
                          'required': 'containers',
                          'types': {'containers': 'array', 'volumes': 'array'}},
 'PodTemplateSpec.spec.containers[]': {'fields': 'args command env envFrom image imagePullPolicy lifecycle '
                                                 'livenessProbe name ports readinessProbe resizePolicy '
                                                 'resources restartPolicy restartPolicyRules '
                                                 'securityContext startupProbe stdin stdinOnce '
                                                 'terminationMessagePath terminationMessagePolicy tty '
                                                 'volumeDevices volumeMounts workingDir',
                                       'required': 'name',
                                       'types': {'image': 'string',
                                                 'name': 'string',
                                                 'ports': 'array',
                                                 'resources': 'object',
                                                 'volumeMounts': 'array'}},
 'PodTemplateSpec.spec.containers[].ports[]': {'fields': 'containerPort hostIP hostPort name protocol',
                                               'required': 'containerPort',
                                               'types': {'containerPort': 'integer', 'name': 'string'}},
 'PodTemplateSpec.spec.containers[].resources': {'fields': 'claims limits requests',
                                                 'types': {'limits': 'object', 'requests': 'object'}},
 'PodTemplateSpec.spec.containers[].resources.limits': {'map': 'int-or-string'},
 'PodTemplateSpec.spec.containers[].resources.requests': {'map': 'int-or-string'},
 'PodTemplateSpec.spec.containers[].volumeMounts[]': {'fields': 'mountPath mountPropagation name readOnly '
                                                                'recursiveReadOnly subPath subPathExpr',
                                                      'required': 'mountPath name',
                                                      'types': {'mountPath': 'string', 'name': 'string'}},
 'PodTemplateSpec.spec.volumes[]': {'fields': 'awsElasticBlockStore azureDisk azureFile cephfs cinder '
                                              'configMap csi downwardAPI emptyDir ephemeral fc flexVolume '
                                              'flocker gcePersistentDisk gitRepo glusterfs hostPath image '
                                              'iscsi name nfs persistentVolumeClaim photonPersistentDisk '
                                              'portworxVolume projected quobyte rbd scaleIO secret '
                                              'storageos vsphereVolume',
                                    'required': 'name',
                                    'types': {'emptyDir': 'object',
                                              'name': 'string',
                                              'persistentVolumeClaim': 'object'}},
 'PodTemplateSpec.spec.volumes[].emptyDir': {'fields': 'medium sizeLimit', 'types': {'medium': 'string'}},
 'PodTemplateSpec.spec.volumes[].persistentVolumeClaim': {'fields': 'claimName readOnly',
                                                          'required': 'claimName',
                                                          'types': {'claimName': 'string'}},
 'RayCluster': {'fields': 'apiVersion kind metadata spec status',
                'types': {'apiVersion': 'string',
                          'kind': 'string',
                          'metadata': 'object',
                          'spec': 'object'}},
 'RayCluster.metadata': {'map': 'any'},
 'RayCluster.spec': {'fields': 'authOptions autoscalerOptions enableInTreeAutoscaling '
                               'gcsFaultToleranceOptions headGroupSpec headServiceAnnotations '
                               'historyServerOptions managedBy networkPolicy rayVersion suspend tlsOptions '
                               'upgradeStrategy workerGroupSpecs',
                     'required': 'headGroupSpec',
                     'types': {'authOptions': 'object',
                               'headGroupSpec': 'object',
                               'rayVersion': 'string',
                               'workerGroupSpecs': 'array'}},
 'RayCluster.spec.authOptions': {'enums': {'mode': ['disabled', 'token']},
                                 'fields': 'enableK8sTokenAuth mode secretName',
                                 'types': {'mode': 'string'}},
 'RayCluster.spec.headGroupSpec': {'fields': 'enableIngress headService ingressOptions labels '
                                             'rayStartParams resources serviceType template',
                                   'required': 'template',
                                   'types': {'rayStartParams': 'object', 'template': 'object'}},
 'RayCluster.spec.headGroupSpec.rayStartParams': {'map': 'string'},
 'RayCluster.spec.workerGroupSpecs[]': {'fields': 'groupName idleTimeoutSeconds labels maxReplicas '
                                                  'minReplicas numOfHosts priority rayStartParams replicas '
                                                  'resources scaleStrategy suspend template',
                                        'required': 'groupName maxReplicas minReplicas template',
                                        'types': {'groupName': 'string',
                                                  'labels': 'object',
                                                  'maxReplicas': 'integer',
                                                  'minReplicas': 'integer',
                                                  'rayStartParams': 'object',
                                                  'replicas': 'integer',
                                                  'resources': 'object',
                                                  'template': 'object'}},
 'RayCluster.spec.workerGroupSpecs[].labels': {'map': 'string'},
 'RayCluster.spec.workerGroupSpecs[].rayStartParams': {'map': 'string'},
 'RayCluster.spec.workerGroupSpecs[].resources': {'map': 'string'},
 'RayJob': {'fields': 'apiVersion kind metadata spec status',
            'types': {'apiVersion': 'string', 'kind': 'string', 'metadata': 'object', 'spec': 'object'}},
 'RayJob.metadata': {'map': 'any'},
 'RayJob.spec': {'fields': 'activeDeadlineSeconds backoffLimit clusterSelector deletionStrategy entrypoint '
                           'entrypointNumCpus entrypointNumGpus entrypointResources jobId managedBy '
                           'metadata preRunningDeadlineSeconds rayClusterSpec runtimeEnvYAML '
                           'shutdownAfterJobFinishes submissionMode submitterConfig submitterPodTemplate '
                           'suspend ttlSecondsAfterFinished',
                 'types': {'activeDeadlineSeconds': 'integer',
                           'entrypoint': 'string',
                           'rayClusterSpec': 'object',
                           'shutdownAfterJobFinishes': 'boolean',
                           'submissionMode': 'string',
                           'submitterConfig': 'object',
                           'ttlSecondsAfterFinished': 'integer'}},
 'RayJob.spec.submitterConfig': {'fields': 'backoffLimit', 'types': {'backoffLimit': 'integer'}}}
